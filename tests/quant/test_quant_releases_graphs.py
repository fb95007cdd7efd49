"""quantize_model leaves nothing behind: once its result is dropped, no graph module of the
export, prepare or convert stays reachable (torch and torchao keep module-level caches keyed by
the modules they saw; :func:`npuq.quantize.pt2e.forget_graphs`). Checked in a fresh interpreter,
because other tests of this session hold graph modules of their own."""

import subprocess
import sys

SCRIPT = r"""
import gc, weakref, torch
from npuq.testing.tiny import tiny_decoder
from npuq.quant.recipe import RECIPES
from npuq.quantize.pt2e import quantize_model

torch.manual_seed(0)
_, model = tiny_decoder("qwen2", seed=0, max_context=16)
tokens = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist()
qm = quantize_model(model, RECIPES["16a8w"], tokens, context=16, prefill_len=4)
programs = [weakref.ref(qm.decode), weakref.ref(qm.prefill)]
alive = [o for o in gc.get_objects() if isinstance(o, torch.fx.GraphModule)]
print("with result", len(alive))
del alive, qm
gc.collect()
print("programs", sum(r() is not None for r in programs))
print("graph modules", sum(isinstance(o, torch.fx.GraphModule) for o in gc.get_objects()))
"""


def test_no_graph_module_outlives_the_quantized_model():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, check=True).stdout
    counts = dict(line.rsplit(" ", 1) for line in out.strip().splitlines())
    assert int(counts["with result"]) >= 2  # the decode and prefill programs at least: the count can see them
    assert counts["programs"] == "0" and counts["graph modules"] == "0", out
