"""Routing: which experts each token goes to, and with what weight (vLLM's ``fused_topk`` / ``grouped_topk``).

Every variant computes in fp32 on the router's logits ``[T, E]`` and returns
``(topk_weights [T, K] float32, topk_ids [T, K] int64)``, ids in descending order of the
selection score. The variants the supported architectures use:

- softmax top-k, optionally renormalized over the chosen k (Qwen2-MoE / Qwen3-MoE's
  ``norm_topk_prob``);
- softmax top-k where a per-expert correction bias enters the *selection* only and the
  weights are the unbiased probabilities, renormalized with a floor (ERNIE 4.5's
  ``moe_statics.e_score_correction_bias`` and ``moe_norm_min``);
- grouped top-k on sigmoid (or softmax) scores: experts split into ``num_expert_group``
  groups, only the best ``topk_group`` groups compete, weights scaled by
  ``routed_scaling_factor`` (DeepSeek-V2/V3's ``n_group`` / ``topk_group``; with a
  correction bias a group's score is the sum of its two best biased scores, as in V3).

With ``use_kernel`` (the platform's ``moe_routing == "csrc"``) all of it is one op per call,
``fd_select_experts`` (csrc/cpu/moe_routing.cc, vLLM's ``topk_softmax`` / ``grouped_topk``); the Paddle
ops here are its reference and the path without the kernels. Equal choices pick the lower expert id.
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F

from fastdeploy import _custom_ops as ops

SCORING_FUNCS = ("softmax", "sigmoid")


def _scores(router_logits: paddle.Tensor, scoring_func: str) -> paddle.Tensor:
    logits = router_logits.astype("float32")
    return F.softmax(logits, axis=-1) if scoring_func == "softmax" else F.sigmoid(logits)


def _group_mask(choice: paddle.Tensor, num_expert_group: int, topk_group: int, biased: bool) -> paddle.Tensor:
    """``choice`` with the experts outside each token's best ``topk_group`` groups set to -inf."""
    num_tokens, num_experts = choice.shape
    grouped = choice.reshape([num_tokens, num_expert_group, num_experts // num_expert_group])
    if biased:  # DeepSeek-V3: a group scores the sum of its two best (biased) experts
        group_scores = paddle.topk(grouped, min(2, grouped.shape[-1]), axis=-1)[0].sum(axis=-1)
    else:
        group_scores = grouped.max(axis=-1)
    best_groups = paddle.topk(group_scores, topk_group, axis=-1)[1]
    keep = F.one_hot(best_groups, num_expert_group).sum(axis=1) > 0  # [T, G]
    keep = keep.unsqueeze(-1).expand_as(grouped).reshape([num_tokens, num_experts])
    return paddle.where(keep, choice, paddle.full_like(choice, float("-inf")))


def select_experts(
    router_logits: paddle.Tensor,
    top_k: int,
    renormalize: bool,
    *,
    scoring_func: str = "softmax",
    e_score_correction_bias: paddle.Tensor | None = None,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
    renormalize_min: float = 0.0,
    use_kernel: bool = False,
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """The top-k experts of each token and their weights.

    Args:
        router_logits: ``[T, E]`` gate outputs.
        top_k: experts per token.
        renormalize: divide the k weights by their sum.
        scoring_func: "softmax" or "sigmoid", applied to the logits first.
        e_score_correction_bias: ``[E]`` (or ``[1, E]``) added to the scores for choosing only.
        num_expert_group / topk_group: grouped routing (both or neither).
        routed_scaling_factor: multiplies the final weights.
        renormalize_min: floor of the sum when renormalizing (ERNIE's ``moe_norm_min``).
        use_kernel: run ``fd_select_experts`` (built kernels only) instead of the Paddle ops.

    Returns:
        ``(topk_weights [T, K] float32, topk_ids [T, K] int64)``.
    """
    num_experts = router_logits.shape[-1]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the number of experts), got {top_k}.")
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func must be one of {list(SCORING_FUNCS)}, got {scoring_func!r}.")
    if (num_expert_group is None) != (topk_group is None):
        raise ValueError("Grouped routing needs both num_expert_group and topk_group.")
    grouped = num_expert_group is not None and num_expert_group > 1
    if grouped:
        if num_experts % num_expert_group:
            raise ValueError(f"num_expert_group={num_expert_group} does not divide the {num_experts} experts.")
        if not 0 < topk_group <= num_expert_group:
            raise ValueError(f"topk_group must be in [1, {num_expert_group}], got {topk_group}.")
        if top_k > topk_group * (num_experts // num_expert_group):
            raise ValueError(f"top_k={top_k} is more than the {topk_group} kept groups of "
                             f"{num_experts // num_expert_group} experts hold.")
    if use_kernel:
        # The op takes the [E] or [1, E] parameter as it is (one value per expert): no per-step reshape.
        bias = e_score_correction_bias
        if bias is not None and bias.dtype != paddle.float32:
            bias = bias.astype("float32")
        logits = router_logits if router_logits.dtype == paddle.float32 else router_logits.astype("float32")
        return ops.select_experts(logits, bias, top_k, renormalize, scoring_func,
                                  num_expert_group if grouped else 0, topk_group if grouped else 0,
                                  routed_scaling_factor, renormalize_min)
    scores = _scores(router_logits, scoring_func)
    choice = scores
    if e_score_correction_bias is not None:
        choice = scores + e_score_correction_bias.astype("float32").reshape([1, num_experts])
    if grouped:
        choice = _group_mask(choice, num_expert_group, topk_group, e_score_correction_bias is not None)
    topk_ids = paddle.topk(choice, top_k, axis=-1)[1]
    topk_weights = paddle.take_along_axis(scores, topk_ids, axis=-1)
    if renormalize:
        total = topk_weights.sum(axis=-1, keepdim=True)
        topk_weights = topk_weights / (paddle.clip(total, min=renormalize_min) if renormalize_min > 0 else total)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids.astype("int64")
