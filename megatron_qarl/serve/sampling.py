"""Sampling and log-probabilities of the embedded engine, with SGLang 0.5.23's semantics (pure functions on fp32
logits; docs/rollout.md, 'Sampling and log-probabilities', cites the SGLang source).

Output tokens (``sample``): temperature applies. Prompt tokens (``prompt_logprobs``): it does not. So at a
temperature T != 1 the log-probability SGLang reports for a token depends on whether it was generated or given:

    output_token_logprobs[i] = log_softmax(z / T)[x]     (the sampler's, sglang/srt/layers/sampler.py)
    input_token_logprobs[t]  = log_softmax(z)[x]         (sglang/srt/layers/logprob_processor.py,
                                                          InputLogprobProcessor: the raw logits)

A rescore that reads ``input_token_logprobs`` therefore gets unscaled log-probabilities whatever the request's
temperature (train/pipeline.py's mismatch split compares them with the learner's unscaled ones).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_qarl.serve.request import SamplingParams

LogSoftmax = Callable[[torch.Tensor], torch.Tensor]  # log-softmax over the last dim (numerics.ops's when exact)


def torch_log_softmax(z: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(z, dim=-1)

SAMPLING_EPS = 1e-6  # SGLang's: a temperature below it is greedy


def sample(logits_V: torch.Tensor, params: SamplingParams, generator: torch.Generator,
           original_logprob: bool, log_softmax: LogSoftmax = torch_log_softmax) -> tuple[int, float]:
    """(token, its log-probability) from the fp32 logits ``z`` of one sequence's next position.

    Greedy (T < 1e-6, or top_k = 1): x = argmax z, log-prob log_softmax(z / T')[x] with T' = 1 when T < 1e-6, else T.
    Otherwise: p = softmax(z / T); top-k keeps p_v >= the k-th largest; top-p drops v when the mass of the tokens
    ranked before it exceeds top_p * sum(p); x ~ p (renormalised) drawn with ``generator``. The log-prob is taken
    before the filters, as SGLang's sampler: log_softmax(z / T)[x], or log_softmax(z)[x] with ``original_logprob``
    (SGLang's ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``). ``log_softmax``: the function every log-prob comes from
    (``numerics.ops.log_softmax`` under ``numerics: exact``, the learner's)."""
    if params.temperature < SAMPLING_EPS or params.top_k == 1:
        token = int(torch.argmax(logits_V))
        scaled = logits_V if params.temperature < SAMPLING_EPS else logits_V / params.temperature
        return token, float(log_softmax(scaled)[token])
    logp_V = log_softmax(logits_V / params.temperature)
    probs_V = logp_V.exp()
    if 0 < params.top_k < probs_V.numel():
        kth = torch.topk(probs_V, params.top_k).values[-1]
        probs_V = torch.where(probs_V < kth, 0.0, probs_V)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs_V, descending=True)
        drop = (torch.cumsum(sorted_p, 0) - sorted_p) > params.top_p * sorted_p.sum()
        probs_V = probs_V.scatter(0, order, torch.where(drop, 0.0, sorted_p))
    token = int(torch.multinomial(probs_V, 1, generator=generator))
    if original_logprob:
        return token, float(log_softmax(logits_V)[token])
    return token, float(logp_V[token])


def prompt_logprobs(logits_TV: torch.Tensor, token_ids: list[int],
                    log_softmax: LogSoftmax = torch_log_softmax) -> list[float | None]:
    """SGLang's ``input_token_logprobs`` of a sequence from the fp32 logits of all its positions [T, V]:
    [None, lp_1, ..., lp_{T-1}] with lp_t = log_softmax(z_{t-1})[x_t], the UNSCALED distribution at any request
    temperature (the first token has no predecessor)."""
    logp = log_softmax(logits_TV[:-1]).gather(-1, torch.tensor(token_ids[1:])[:, None])[:, 0]
    return [None, *logp.tolist()]
