"""The router variants against transformers' own routers, over many random tokens."""
import pytest
import torch

from ainfer_pd.engine.model.routing import RouterSpec, route


def _combine(idx, w, E):
    """[T, E] dense combine weights (order of the k slots does not matter)."""
    return torch.zeros(idx.shape[0], E, dtype=torch.float32).scatter_add_(1, idx, w.float())


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_router_equals_qwen_topk_router(norm):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    cfg = Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm)
    gate = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(gate.weight, std=0.5)
    x = torch.randn(512, 32)
    _, w, idx = gate(x)
    r = route(x, gate.weight, RouterSpec("softmax", 4, norm_topk_prob=norm))
    assert torch.allclose(_combine(r.topk_idx, r.topk_weights, 16), _combine(idx, w, 16), atol=1e-6)
    assert r.counts.tolist() == torch.bincount(idx.reshape(-1), minlength=16).tolist()
    assert r.offsets.tolist() == torch.cumsum(r.counts, 0).tolist()


def test_softmax_router_with_renormalisation_equals_mixtral_router():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    gate = MixtralTopKRouter(MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2))
    torch.nn.init.normal_(gate.weight, std=0.5)
    x = torch.randn(512, 32)
    _, w, idx = gate(x)
    r = route(x, gate.weight, RouterSpec("softmax", 2, norm_topk_prob=True))
    assert torch.allclose(_combine(r.topk_idx, r.topk_weights, 8), _combine(idx, w, 8), atol=1e-6)


@pytest.mark.parametrize("n_group,topk_group,norm,scale", [(4, 2, True, 2.5), (8, 3, False, 1.0), (1, 1, True, 1.5)])
def test_sigmoid_group_limited_router_equals_glm4_moe(n_group, topk_group, norm, scale):
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE
    cfg = Glm4MoeConfig(hidden_size=32, moe_intermediate_size=8, n_routed_experts=16, num_experts_per_tok=4,
                        n_group=n_group, topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scale)
    moe = Glm4MoeMoE(cfg)
    torch.nn.init.normal_(moe.gate.weight, std=0.5)
    moe.gate.e_score_correction_bias.normal_(std=0.3)
    x = torch.randn(512, 32)
    idx, w = moe.route_tokens_to_experts(moe.gate(x))
    spec = RouterSpec("sigmoid", 4, norm_topk_prob=norm, num_groups=n_group, topk_groups=topk_group, scaling=scale)
    r = route(x, moe.gate.weight, spec, moe.gate.e_score_correction_bias)
    assert torch.equal(r.topk_idx.sort(-1).values, idx.sort(-1).values)      # the same experts chosen
    assert torch.allclose(_combine(r.topk_idx, r.topk_weights, 16), _combine(idx, w, 16), atol=1e-6)
    if topk_group < n_group:     # the group limit binds: some token's plain top-4 differs
        plain = (moe.gate(x).sigmoid() + moe.gate.e_score_correction_bias).topk(4).indices.sort(-1).values
        assert not torch.equal(plain, idx.sort(-1).values)
