"""Loading RWKV checkpoints: BlinkDL .pth / .safetensors files, Hugging Face model directories, hub ids,
and rwkv-engine's own converted directories.

The steps, each done once, each in its module:
1. resolve: a local file or directory, or a Hugging Face Hub id (downloaded through huggingface_hub);
2. formats: the file type is sniffed from its bytes, never its name; tensors stay memory-mapped and
   are read one at a time, so no second full copy of the weights is made;
3. names: Hugging Face and flash-linear-attention names are mapped back to BlinkDL's
   (docs/formats.md B.1-B.4), with fla's transposed LoRA matrices turned back;
4. infer: version and sizes from the keys and tensor shapes (and config.json when there is one);
5. transforms: each tensor into the form our modules hold (ln0 folded, log decays, one mix
   convention, fp16 rescale, dtype cast), checked against the shape the model expects; a
   state-tuned file's time_state (RWKV-6/7) becomes the model's initial state;
6. plan: the module tree is created on the meta device and the tensors are assigned into it
   (`load`), or written to a converted directory (`converted.convert`).
"""

from .formats import DTYPE_NAMES, DTYPES, Checkpoint, SafetensorsWriter, open_checkpoint, parse_dtype
from .names import canonical_name
from .plan import FP16_RESCALE_EVERY, Plan, auto_dtype, load, prepare
from .resolve import resolve

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "FP16_RESCALE_EVERY",
    "Checkpoint",
    "Plan",
    "SafetensorsWriter",
    "auto_dtype",
    "canonical_name",
    "load",
    "open_checkpoint",
    "parse_dtype",
    "prepare",
    "resolve",
]
