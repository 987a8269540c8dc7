"""mcompile: Megatron-style parallel training as a compiler over torch.export graphs."""

from mcompile.mesh import Mesh

__version__ = "0.1.0"
__all__ = ["Mesh", "__version__"]
