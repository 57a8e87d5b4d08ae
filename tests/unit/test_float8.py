"""The float8 teacher's layers (keel.models.float8), on the CPU's _scaled_mm: the same matmul the
GPU's float8 tensor cores run, at e4m3's precision."""

import pytest
import torch
from torch import nn

from keel.models.float8 import Float8Linear, quantize_layers_float8, to_float8_rows


def test_rows_scale_to_e4m3s_range_and_back_within_its_precision():
    torch.manual_seed(0)
    x = torch.randn(8, 64) * torch.logspace(-3, 3, 8)[:, None]
    x[3] = 0
    values, scale = to_float8_rows(x)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (8, 1)
    back = values.float() * scale
    # e4m3: 3 mantissa bits, a relative step of 2^-3 at most, so within 6.25% of each value (the
    # smallest ones, far below their row's largest, lose more)
    big = x.abs() > 0.1 * x.abs().amax(-1, keepdim=True)
    assert torch.all((back - x).abs()[big] <= 0.0625 * x.abs()[big])
    # a row of zeros stays zeros, not NaN
    assert torch.equal(back[3], torch.zeros(64))


def test_a_float8_linear_is_near_the_bf16_one_and_unbiased():
    torch.manual_seed(0)
    linear = nn.Linear(256, 128).to(torch.bfloat16)
    x = torch.randn(4, 10, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        want = linear(x).float()
        got = Float8Linear(linear)(x)
    assert got.shape == (4, 10, 128) and got.dtype == torch.bfloat16
    error = got.float() - want
    # relative to the outputs' spread: each product rounds two factors to 3 mantissa bits, and
    # the errors of 256 terms partly cancel
    assert error.abs().max() < 0.1 * want.abs().max()
    assert abs(float(error.mean())) < 0.01 * float(want.abs().mean())


def test_a_models_decoder_layers_go_float8_and_its_output_layer_stays(tmp_path):
    from keel.models.load import load_causal_lm
    from keel.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "m", hidden_size=64, num_layers=2)
    model = load_causal_lm(path, torch.device("cpu"), dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 200, (2, 12))
    with torch.no_grad():
        want = model(ids).logits.float().log_softmax(-1)
        quantize_layers_float8(model)
        got = model(ids).logits.float().log_softmax(-1)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, Float8Linear)
    assert isinstance(layer.mlp.down_proj, Float8Linear)
    assert isinstance(model.get_output_embeddings(), nn.Linear)
    assert not isinstance(model.get_output_embeddings(), Float8Linear)
    assert torch.isfinite(got).all()
    # the log-prob of each token, near bf16's
    torch.testing.assert_close(got, want, atol=0.5, rtol=0.1)


@pytest.mark.parametrize("sizes", [(64, 24), (24, 64)])
def test_a_linear_of_sizes_scaled_mm_cannot_take_stays_as_it_is(sizes):
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(*sizes)
            self.head = nn.Linear(64, 32)

        def get_output_embeddings(self):
            return self.head

    model = quantize_layers_float8(Holder())
    assert type(model.inner) is nn.Linear
