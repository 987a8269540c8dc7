"""What a new user hands to capture: Hugging Face models as they are (a ModelOutput holding a cache,
positional (ids, labels)), outputs that cannot be captured, and each class of capture failure with the
cause and the fix its message must give (issue 18)."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch

from mcompile import Mesh
from mcompile.api import compile_plan
from mcompile.capture.export import CaptureError, CaptureWarning, OutputWarning, capture, warn_unless_loss
from mcompile.runtime.sim import ThreadedWorld, run_threads

pytestmark = pytest.mark.timeout(120)

VOCAB = 128


def _hf(kind: str = "llama"):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16))
    return LlamaForCausalLM(LlamaConfig(**common)).eval()  # eval: the cache is on, as for generation


def tiny_qwen3():
    """A factory as the CLI loads it (``mcompile plan test_capture_newuser:tiny_qwen3``): a bare HF model."""
    return _hf("qwen3")


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    labels = torch.randint(0, VOCAB, (2, 16), generator=g)
    labels[0, :5] = -100
    return ids, labels


def _message(model, *inputs, kwargs=None) -> str:
    with pytest.raises(CaptureError) as e:
        capture(model, inputs, kwargs)
    return str(e.value)


def _line(msg: str, key: str) -> str:
    """The message's line that starts with ``key`` ("fix:", "at", ...), or its first line for "cause"."""
    if key == "cause":
        return msg.splitlines()[0]
    return next(ln.strip() for ln in msg.splitlines() if ln.strip().startswith(key))


# -- outputs users have ------------------------------------------------------------------------------------------


def test_hf_model_output_with_a_cache_is_captured_as_its_loss_and_runs_at_tp2():
    """LlamaForCausalLM in eval mode returns a ModelOutput holding a DynamicCache: capture takes its loss,
    and the tp=2 programs compute the single-device loss."""
    model = _hf()
    ids, labels = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutputWarning)
        c = compile_plan(model, Mesh(tp=2), (ids,), {"labels": labels})
        warn_unless_loss(c.captured)  # a scalar loss: no warning
    assert c.captured.output == "CausalLMOutputWithPast.loss"
    assert c.captured.input_names == ["input_ids", "labels"]
    ref = model(input_ids=ids, labels=labels).loss
    state = c.captured.state_values()
    out = run_threads(ThreadedWorld(c.mesh),
                      lambda r: c.run_local(r, c.local_state(r, state), (ids,), {"labels": labels})[0])
    for loss in out:
        torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)  # fp32, 2 layers: summation order only


def test_hf_model_without_labels_is_captured_as_its_logits_and_a_training_plan_warns():
    model = _hf()
    ids, _ = _batch()
    cap = capture(model, (ids,))
    assert cap.output == "CausalLMOutputWithPast.logits"
    torch.testing.assert_close(cap.ep.module()(ids), model(ids).logits, rtol=1e-5, atol=1e-6)
    with pytest.warns(OutputWarning) as w:
        warn_unless_loss(cap)
    msg = str(w[0].message)
    assert "output is CausalLMOutputWithPast.logits of shape [batch, seq, 128], not a scalar loss" in msg
    assert "(the model got no labels)" in msg and "fix: return the loss from forward, or pass labels" in msg


class _Returns(torch.nn.Module):
    def __init__(self, make):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.make = make

    def forward(self, x):
        return self.make(self.lin(x))


class _Cache:  # an object torch.export cannot flatten (as transformers' DynamicCache)
    pass


@pytest.mark.parametrize("make,cause", [
    (lambda h: "done", "forward returns a str, not a tensor"),
    (lambda h: None, "forward returns None, not a tensor"),
    (lambda h: (h.sum(), _Cache()), "forward returns a tuple whose element output[1] is a "
                                    "test_capture_newuser._Cache, not a tensor"),
    (lambda h: {"hidden": h, "pooled": h.mean(1)}, "forward returns a dict with fields hidden (Tensor), "
                                                     "pooled (Tensor), none of them a 'loss' or 'logits' tensor"),
])
def test_an_output_that_cannot_be_captured_says_what_it_is(make, cause):
    msg = _message(_Returns(make), torch.randn(2, 4, 8))
    assert cause in _line(msg, "cause"), msg
    assert "def forward(self, x):" in _line(msg, "at")
    assert _line(msg, "fix:").startswith("fix: return")
    assert "data-dependent" not in msg


def test_dict_and_dataclass_outputs_give_their_loss_or_their_only_tensor():
    from dataclasses import dataclass

    @dataclass
    class Out:
        loss: torch.Tensor | None
        logits: torch.Tensor

    x = torch.randn(2, 4, 8)
    cap = capture(_Returns(lambda h: Out(loss=h.pow(2).mean(), logits=h)), (x,))
    assert cap.output == "Out.loss" and cap.gm.graph.output_node().args[0][0].meta["val"].ndim == 0
    assert capture(_Returns(lambda h: Out(loss=None, logits=h)), (x,)).output == "Out.logits"
    assert capture(_Returns(lambda h: {"hidden": h}), (x,)).output == "dict.hidden"
    tup = capture(_Returns(lambda h: (h.sum(), h)), (x,))  # several tensors: kept (inference outputs)
    assert tup.output == "a tuple of 2 tensors"
    with pytest.warns(OutputWarning, match=r"output is a tuple of 2 tensors of shape \[\], \[batch, seq, 8\]"):
        warn_unless_loss(tup)


# -- silent wrong plans: positional inputs of a Hugging Face model -------------------------------------------------


def test_hf_positional_ids_and_labels_bind_to_input_ids_and_labels():
    """mc.plan(Qwen3ForCausalLM(cfg), mesh, (ids, labels)) plans the loss (Python would bind the labels to
    attention_mask and plan a model without one)."""
    model = _hf("qwen3")
    ids, labels = _batch()
    c = compile_plan(model, Mesh(tp=2), (ids, labels))
    assert c.captured.input_names == ["input_ids", "labels"]
    assert c.captured.output == "CausalLMOutputWithPast.loss"
    torch.testing.assert_close(c.captured.ep.module()(input_ids=ids, labels=labels),
                               model(input_ids=ids, labels=labels).loss, rtol=1e-5, atol=1e-6)
    # a 0/1 second input stays the attention mask, as in Python: no labels, the logits
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cap = capture(model, (ids, mask))
    assert cap.input_names == ["input_ids", "attention_mask"] and cap.output == "CausalLMOutputWithPast.logits"


def test_hf_positional_inputs_that_cannot_be_read_are_refused():
    model = _hf("qwen3")
    ids, labels = _batch()
    msg = _message(model, ids, labels, torch.ones_like(ids))
    assert "3 positional example inputs for a Hugging Face model; mcompile reads them as (input_ids, labels)" in msg
    assert "fix: pass the others by keyword" in msg
    msg = _message(model, ids, labels, kwargs={"labels": labels})
    assert "labels given twice" in msg and "fix: pass (input_ids,) and labels=..." in msg


def test_cli_factory_returning_a_bare_hf_model_plans_its_loss():
    from mcompile.apps.cli import load_model

    model, inputs, _ = load_model("test_capture_newuser:tiny_qwen3", "meta", 2, 16)
    c = compile_plan(model, Mesh.fake(tp=2), inputs)
    assert c.captured.input_names == ["input_ids", "labels"]
    assert c.captured.output == "CausalLMOutputWithPast.loss"
    assert any(n.target is torch.ops.aten.cross_entropy_loss.default for n in c.captured.gm.graph.nodes)


class _MaskFirst(torch.nn.Module):
    """forward(input_ids, attention_mask, labels): positional (ids, labels) puts the labels on the mask."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.emb(input_ids)
        if attention_mask is not None:
            h = h * attention_mask[..., None]
        logits = self.head(h)
        return logits if labels is None else torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_labels_bound_to_a_mask_are_refused():
    ids, labels = _batch()
    msg = _message(_MaskFirst(), ids, labels)
    cause = _line(msg, "cause")
    assert f"positional example input #2 (torch.int64, values -100..{int(labels.max())}) binds to forward's " \
           "parameter 'attention_mask', but it is not a 0/1 mask" in cause
    assert "def forward(self, input_ids, attention_mask=None, labels=None):" in _line(msg, "at")
    assert "fix: pass it by keyword" in _line(msg, "fix:") and "{'labels': labels}" in msg
    # a real 0/1 mask, and the labels by keyword: captured, with the loss
    cap = capture(_MaskFirst(), (ids, torch.ones_like(ids)), {"labels": labels})
    assert cap.gm.graph.output_node().args[0][0].meta["val"].ndim == 0


# -- capture failure classes: cause and fix ------------------------------------------------------------------------


class _Base(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.seen = []
        self.steps = torch.zeros(())  # a plain tensor attribute, not a buffer


class _Branch(_Base):
    def forward(self, x):
        h = self.lin(x)
        if h.sum() > 0:  # data-dependent branch
            h = h * 2
        return h.sum()


class _Item(_Base):
    def forward(self, x):
        h = self.lin(x)
        return h.sum() * int(h.abs().sum().item())  # data-dependent .item()


class _Tolist(_Base):
    def forward(self, x):
        h = self.lin(x)
        if h[0, 0].tolist()[0] > 0:  # data-dependent .tolist()
            h = -h
        return h.sum()


class _Numpy(_Base):
    def forward(self, x):
        h = self.lin(x)
        return torch.from_numpy(np.tanh(h.detach().numpy())).sum()  # numpy call


@torch.library.custom_op("mcompile_test::no_fake", mutates_args=())
def _no_fake(a: torch.Tensor) -> torch.Tensor:
    return a.clone()


_LIB = torch.library.Library("mcompile_test2", "DEF")
_LIB.define("cpu_only(Tensor x) -> Tensor")
_LIB.impl("cpu_only", lambda a: a.clone(), "CPU")


class _CustomOp(_Base):
    def forward(self, x):
        return _no_fake(self.lin(x)).sum()  # custom op without a fake kernel


class _LibOp(_Base):
    def forward(self, x):
        return torch.ops.mcompile_test2.cpu_only(self.lin(x)).sum()  # op with a CPU kernel only


class _Positive(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a[a > 0]  # output shape depends on values: cannot be an op with a fake implementation

    @staticmethod
    def backward(ctx, g):
        return g


class _NumpyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return torch.from_numpy(np.tanh(a.numpy()))  # numpy inside a Function's forward

    @staticmethod
    def backward(ctx, g):
        return g


class _FnShape(_Base):
    def forward(self, x):
        return _Positive.apply(self.lin(x)).sum()


class _FnNumpy(_Base):
    def forward(self, x):
        return _NumpyFn.apply(self.lin(x)).sum()


class _Append(_Base):
    def forward(self, x):
        h = self.lin(x)
        self.seen.append(h)  # side effect: a list on self
        return h.sum()


_GLOBAL_LOG = []


class _Global(_Base):
    def forward(self, x):
        h = self.lin(x)
        _GLOBAL_LOG.append(h.sum())  # side effect: a global
        return h.sum()


class _AttrAssign(_Base):
    def forward(self, x):
        h = self.lin(x)
        self.steps = self.steps + 1  # side effect: a tensor attribute replaced
        return h.sum()


class _AttrInPlace(_Base):
    def forward(self, x):
        h = self.lin(x)
        self.steps += 1  # side effect: a tensor attribute (not a buffer) updated in place
        return h.sum()


class _BadView(_Base):
    def forward(self, x):
        return self.lin(x.view(3, -1, 8)).sum()  # wrong for these inputs: an error in eager mode too


CLASSES = {
    "branch": (_Branch, "data-dependent control flow", "if h.sum() > 0:", "torch.where"),
    "item": (_Item, "data-dependent control flow", "int(h.abs().sum().item())", "torch.where"),
    "tolist": (_Tolist, "data-dependent control flow", "h[0, 0].tolist()[0] > 0", "torch.where"),
    "numpy": (_Numpy, "forward converts a tensor to numpy", "np.tanh(h.detach().numpy())",
              "replace the numpy call with the torch op"),
    "custom_op": (_CustomOp, "the op mcompile_test::no_fake has no fake (meta) kernel", "_no_fake(self.lin(x))",
                  "register a fake kernel for mcompile_test::no_fake"),
    "lib_op": (_LibOp, "the op mcompile_test2.cpu_only.default has no fake (meta) kernel", "cpu_only(self.lin(x))",
               "register a fake kernel for mcompile_test2.cpu_only.default"),
    "autograd_function_shape": (_FnShape, "the forward of the custom torch.autograd.Function _Positive returns a "
                                "tensor whose shape depends on tensor values", "def forward(ctx, a):",
                                "give _Positive.forward outputs of fixed shape"),
    "autograd_function_numpy": (_FnNumpy, "the forward of the custom torch.autograd.Function _NumpyFn cannot run on "
                                "placeholder tensors", "np.tanh(a.numpy())",
                                "write _NumpyFn.forward with torch ops instead of numpy"),
    "list_on_self": (_Append, "forward stores a traced value outside the model (self.seen[0])", "def forward(self, x):",
                     "keep forward free of Python side effects"),
    "global": (_Global, "forward stores a traced value outside the model (global _GLOBAL_LOG[0])",
               "def forward(self, x):", "keep forward free of Python side effects"),
    "attribute": (_AttrAssign, "forward stores a traced value outside the model (self.steps)",
                  "def forward(self, x):", "register state as a buffer"),
    "eager_error": (_BadView, "forward raised RuntimeError on the example inputs", "x.view(3, -1, 8)",
                    "check that model(*example_inputs, **example_kwargs) runs in eager mode"),
    "attribute_in_place": (_AttrInPlace, "forward updates the tensor attribute self.steps in place",
                           "self.steps += 1", "register it as a buffer"),
}


@pytest.mark.parametrize("kind", list(CLASSES))
def test_capture_failure_names_cause_line_and_fix(kind):
    cls, cause, line, fix = CLASSES[kind]
    msg = _message(cls(), torch.randn(2, 4, 8))
    assert re.match(rf"cannot capture {cls.__name__} with torch\.export: ", msg), msg
    assert cause in _line(msg, "cause"), msg
    at = _line(msg, "at")
    assert f"{__file__}:" in at and line in at, msg
    assert fix in _line(msg, "fix:"), msg
    if kind not in ("branch", "item", "tolist"):  # the old catch-all advice was wrong for these
        assert "data-dependent" not in _line(msg, "fix:")


def test_side_effect_fixed_is_captured():
    """The same model with its state as a buffer (updated in place) captures: the check is not a blanket refusal."""

    class Counted(_Base):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls += 1
            return self.lin(x).sum()

    capture(Counted(), (torch.randn(2, 4, 8),))


def test_printing_a_tensor_warns_with_cause_and_fix(capsys):
    class Printing(_Base):
        def forward(self, x):
            h = self.lin(x)
            print(h)
            return h.sum()

    with pytest.warns(CaptureWarning) as w:
        capture(Printing(), (torch.randn(2, 4, 8),))
    msg = str(w[0].message)
    assert "Printing.forward prints a tensor" in msg and "the captured program does not print" in msg
    assert "fix: print outside forward" in msg and "torch.compiler.is_exporting()" in msg
    assert "FakeTensor(" in capsys.readouterr().out  # what the user saw, passed through
