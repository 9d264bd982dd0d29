"""q/k/v and gate/up projections run fused, while the parameters keep their names,
values and memory, and follow later changes (a new state dict, a dtype cast)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from ec_frontend.model.qwen2_text import FusedLinears, Qwen2TextModel, TextModelConfig
from torch import nn

CFG = TextModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
    num_kv_heads=2, rms_norm_eps=1e-6, rope_theta=1e4, mrope_section=(2, 1, 1),
    tie_word_embeddings=False,
)  # fmt: skip


def test_fused_product_equals_the_separate_layers() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(16, n, bias=True) for n in (8, 4, 4)]
    x = torch.randn(5, 16)
    want = torch.cat([F.linear(x, lay.weight, lay.bias) for lay in layers], dim=-1)
    fused = FusedLinears(*layers)
    torch.testing.assert_close(fused(x), want, rtol=0, atol=1e-6)
    # The parameters now view the fused tensors: same values, no second copy.
    assert fused.weight is not None and fused.bias is not None
    assert layers[1].weight.data_ptr() == fused.weight[8].data_ptr()
    assert layers[2].bias.data_ptr() == fused.bias[12].data_ptr()


def test_parameters_keep_names_and_follow_new_values() -> None:
    torch.manual_seed(0)
    model = Qwen2TextModel(CFG)
    names = list(model.state_dict())
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    x = torch.randn(3, CFG.hidden_size)
    attn.qkv(x), mlp.gate_up(x)
    assert list(model.state_dict()) == names
    assert not any("qkv" in n or "gate_up" in n for n in names)

    # A new state dict is copied into the views: the fused product sees it.
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    q = state["layers.0.self_attn.q_proj.weight"]
    torch.testing.assert_close(attn.qkv.weight[: q.shape[0]], q, rtol=0, atol=0)
    want = F.silu(F.linear(x, state["layers.0.mlp.gate_proj.weight"])) * F.linear(
        x, state["layers.0.mlp.up_proj.weight"]
    )
    got = mlp.gate_up(x)
    size = got.shape[-1] // 2
    torch.testing.assert_close(F.silu(got[:, :size]) * got[:, size:], want, rtol=0, atol=1e-5)


def test_a_cast_fuses_again_in_the_new_dtype() -> None:
    torch.manual_seed(0)
    model = Qwen2TextModel(CFG)
    attn = model.layers[0].self_attn
    x = torch.randn(3, CFG.hidden_size)
    attn.qkv(x)
    model.to(torch.float64)
    out = attn.qkv(x.double())
    assert out.dtype == torch.float64 and attn.qkv.weight.dtype == torch.float64
    assert attn.q_proj.weight.data_ptr() == attn.qkv.weight.data_ptr()
    want = torch.cat(
        [attn.q_proj(x.double()), attn.k_proj(x.double()), attn.v_proj(x.double())], -1
    )
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
