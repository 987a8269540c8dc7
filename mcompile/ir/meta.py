"""The ``node.meta`` keys mcompile's passes share — the only channel between passes besides the Plan.

Frozen: every later pass (pipeline split, recompute, overlap, fusion, fp8, search) reads these.
Values are documented next to each key. Keys of torch.export itself (``val``, ``stack_trace``,
``nn_module_stack``) are read, never written.
"""

# Annotation (mcompile.ir.annotate): sympy expressions in the captured batch/sequence symbols.
FLOPS = "mc_flops"  # sympy.Expr: floating-point operations of the node's forward
BYTES_READ = "mc_bytes_read"  # sympy.Expr: bytes of tensor inputs read
BYTES_WRITTEN = "mc_bytes_written"  # sympy.Expr: bytes of tensor outputs written
OUT_BYTES = "mc_out_bytes"  # sympy.Expr: bytes of the node's output(s) (activation memory if saved)

# Planning (mcompile.sharding.propagate): placements per mesh axis, ordered like Plan.mesh.
PLACEMENTS = "mc_placements"  # tuple[Placement, ...] of the node's (first) output; tuple of those for
#                               multi-output nodes (split)
INPUT_PLACEMENTS = "mc_input_placements"  # per tensor argument: tuple[Placement, ...] the op consumes
STRATEGY = "mc_strategy"  # str: name of the chosen rule strategy (for `mcompile explain`)
LOWERING = "mc_lowering"  # str | None: name of a special local lowering (vocab-parallel CE, ...)

# Lowered per-rank programs (mcompile.passes.lower).
COLLECTIVE = "mc_collective"  # mcompile.ir.plan.CollectiveSpec on every inserted collective node
COLLECTIVES = "mc_collectives"  # list[CollectiveSpec]: a node that runs several inside (MoE dispatch, cp attention)
ORIGIN = "mc_origin"  # str: name of the captured-graph node this local node implements
LAYER = "mc_layer"  # int | None: transformer layer index (reporting only), from nn_module_stack
# bool: a node of an attention written out in ops (an SDPA with dropout, passes/canonicalize.py): selective
# recompute's attention core, like an SDPA node (passes/recompute.py, mcompile/cost/model.py)
ATTENTION_CORE = "mc_attention_core"
PARAM_FQN = "mc_param_fqn"  # str: original FQN on parameter/buffer placeholders

# Later per-rank passes (their values are set by the pass named).
FUSED = "mc_fused"  # str: the fused op that replaced a matched pattern (mcompile.passes.fuse)
FP8 = "mc_fp8"  # str: the FP8 scaling recipe of a converted linear, "current" | "delayed" (passes/fp8_linears.py)
STAGE = "mc_stage"  # int | None: the pipeline stage of a node (passes.pipeline_split); None: input-only

# GraphModule.meta keys of a lowered program (passes/lower.py), read by mcompile.sharding.repeat:
EMITTED_FOR = "mc_emitted_for"  # program node name -> the captured node whose lowering emitted it
VALUE_OF = "mc_value_of"  # captured node name -> the program node holding its value

# Capture and its rewrites.
ALIASES = "mc_aliases"  # tuple[bool, ...]: per tensor output, whether it shares storage with an input (capture)
NODE_COST = "_mc_node_cost"  # mcompile.ir.annotate.NodeCost behind the annotation keys (annotate(reuse=True))
LOOP_ITERATION = "mc_loop_iteration"  # (loop, index): the unrolled iteration that traced the node
                                      # (mcompile.capture.loops)
LOOP_MASKS = "mc_loop_masks"  # the loops over this mask's nonzero indices (mcompile.capture.loops)
COPY = "_mc_copy"  # bool: a node copied per repeated layer while mcompile.sharding.repeat grows a program (removed
                   # after)

# Joint programs (passes/joint.py) and what later passes mark on them.
PROGRAM_NODE = "mc_program_node"  # str: the per-rank program node a joint-graph node was traced from
ACC_OUTPUT = "mc_acc_output"  # int: on a gradient accumulation, the backward output position it replaced
NUM_FWD_OUTPUTS = "mc_num_fwd_outputs"  # GraphModule.meta of a joint graph: how many outputs are the forward's
JOINT_FORWARD_NODES = "mc_joint_forward_nodes"  # GraphModule.meta of a joint graph: frozenset of the names of the
                                                # nodes traced in forward (before the first output gradient)
W_INPUTS = "mc_w_inputs"  # GraphModule.meta of zero-bubble's W module: the B inputs it reads
RECOMPUTE_GROUPS = "mc_recompute_groups"  # GraphModule.meta: recompute groups applied (passes/recompute.py)
