"""A tiny Qwen2's decoder layers in float8 (keel.models.float8), eager then compiled: each forward's
time and its logits' distance from bf16's."""
import time, tempfile, torch
from pathlib import Path
from keel.models.tiny import make_tiny_model
from keel.models.load import load_causal_lm
from keel.models.float8 import quantize_layers_float8
d = make_tiny_model(Path(tempfile.mkdtemp()) / "m", hidden_size=256, num_layers=2)
dev = torch.device("cuda")
ref = load_causal_lm(d, dev, dtype=torch.bfloat16).eval()
ids = torch.randint(0, 200, (4, 96), device=dev)
with torch.no_grad():
    want = ref(ids).logits.float()
    m = quantize_layers_float8(load_causal_lm(d, dev, dtype=torch.bfloat16).eval())
    print("quantized", type(m.model.layers[0].self_attn.q_proj.weight).__name__, flush=True)
    t = time.time(); got = m(ids).logits.float(); torch.cuda.synchronize()
    print(f"eager {time.time()-t:.2f}s max diff {(got-want).abs().max():.3f} of {want.abs().max():.2f}", flush=True)
    layer = m.model.layers[0]
    layer.forward = torch.compile(layer.forward)
    t = time.time(); got = m(ids).logits.float(); torch.cuda.synchronize()
    print(f"compiled {time.time()-t:.2f}s max diff {(got-want).abs().max():.3f}", flush=True)
    ids = torch.randint(0, 200, (4, 80), device=dev)
    t = time.time(); m(ids); torch.cuda.synchronize()
    print(f"compiled, new length {time.time()-t:.2f}s", flush=True)
