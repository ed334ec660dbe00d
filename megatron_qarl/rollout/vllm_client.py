"""The rollout manager's requests to a vLLM 0.32 server, in vLLM's own API: ``VLLMClient.generate`` takes what
``SGLangClient.generate`` takes (token ids and the manager's SGLang sampling params) and answers in SGLang's
/generate shape, so the rollout manager, its failover and re-sends are the same for every backend.

One sample is one POST /v1/completions (vllm/entrypoints/openai/completion/protocol.py ``CompletionRequest``):
    prompt: the token ids; max_tokens, temperature, top_p, top_k, stop_token_ids, seed: the sample's sampling
    params (SGLang's ``max_new_tokens``, ``sampling_seed``); logprobs 0: the sampled token's log-prob only;
    return_token_ids: the response's token ids (``choices[0].token_ids``, the stop token included).
The log-probs are of the temperature-scaled logits because the server runs with
``--logprobs-mode processed_logprobs`` (rollout/vllm_launcher.py), as SGLang's and our engine's are; but vLLM's
processed log-probs are taken AFTER its top-k / top-p filter (the renormalized truncated distribution,
vllm/v1/sample/ops/topk_topp_sampler.py), SGLang's and the learner's before it, so with top_p < 1 or top_k on
they would differ by the log of the kept mass: the config refuses those with this backend (preflight/rules.py).
Answer -> SGLang's ``meta_info``: ``output_token_logprobs`` [[logprob, token id, null], ...],
``finish_reason.type`` "stop" / "length" (vLLM's "abort" is a server failure: the manager re-sends the sample),
``weight_version`` the server's at answer time is not in vLLM's answer (None): the trainer knows it instead, since
no weight sync runs while a vLLM rollout round is in flight (train/rollouts.py ``TrainRollouts.generate``).

A prefill score (``logprob_start_len`` k >= 0, SGLang's way of asking for ``input_token_logprobs``: the trainer's
rescore, train/rollouts.py) is the same request with ``prompt_logprobs: 0`` and ``max_tokens`` 1: vLLM answers
``choices[0].prompt_logprobs``, per prompt position i a dict {token id: {"logprob", ...}} holding the log-prob of
prompt token i given the tokens before it (None at position 0); positions k.. become SGLang's
``input_token_logprobs`` [[logprob, token id, null], ...]. Their semantics are SGLang's: the log-softmax of the
UNSCALED logits whatever the temperature (vLLM computes them before any sampling processor, "prompt tokens skip
sampling processors", vllm/v1/worker/gpu_model_runner.py ``_get_prompt_logprobs_dict``; SGLang likewise scales
output tokens only). vLLM skips its prefix cache for such requests (``SamplingParams.skip_reading_prefix_cache``).
"""

from __future__ import annotations

from megatron_qarl.rollout.client import RolloutServerError, SGLangClient

# SGLang sampling param -> vLLM CompletionRequest field (the others are refused: the manager sends only these)
_PARAMS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_new_tokens": "max_tokens",
           "stop_token_ids": "stop_token_ids", "sampling_seed": "seed"}


def completion_request(input_ids: list[int], sampling_params: dict, prompt_logprobs: bool = False) -> dict:
    """The /v1/completions body of one sample (``prompt_logprobs``: with the prompt's log-probs too)."""
    unknown = sorted(set(sampling_params) - set(_PARAMS))
    if unknown:
        raise ValueError(f"sampling params {unknown} have no vLLM completion field here (known: {sorted(_PARAMS)})")
    body = {_PARAMS[k]: v for k, v in sampling_params.items()}
    extra = {"prompt_logprobs": 0} if prompt_logprobs else {}
    return {"prompt": list(input_ids), "logprobs": 0, "return_token_ids": True, "echo": False, "n": 1,
            "skip_special_tokens": False, **extra, **body}


def input_token_logprobs(resp: dict, input_ids: list[int], start: int, url: str) -> list[list]:
    """SGLang's ``input_token_logprobs`` from position ``start`` on, out of vLLM's ``choices[0].prompt_logprobs``
    (position 0 has none: null, as in SGLang)."""
    try:
        rows = resp["choices"][0]["prompt_logprobs"]
        out = [[None if i == 0 else float(rows[i][str(t)]["logprob"]), int(t), None]
               for i, t in enumerate(input_ids) if i >= start]
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise RolloutServerError(f"{url}/v1/completions: no prompt log-probs for positions {start}.. of "
                                 f"{len(input_ids)} ({err!r})") from None
    return out


def to_sglang_answer(resp: dict, url: str) -> dict:
    """A /v1/completions answer of one sample -> SGLang's /generate answer (the fields the manager reads)."""
    try:
        choice = resp["choices"][0]
        ids, lps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    except (KeyError, IndexError, TypeError) as err:
        raise RolloutServerError(f"{url}/v1/completions: answer without token ids and log-probs ({err!r})") from None
    if choice.get("finish_reason") not in ("stop", "length"):
        raise RolloutServerError(f"{url}/v1/completions: finish_reason {choice.get('finish_reason')!r} (aborted)",
                                 status=503)
    if len(ids) != len(lps) or any(lp is None for lp in lps):
        raise RolloutServerError(f"{url}/v1/completions: {len(ids)} token ids but log-probs {lps!r}")
    return {"text": choice.get("text", ""),
            "meta_info": {"output_token_logprobs": [[float(lp), int(t), None] for lp, t in zip(lps, ids, strict=True)],
                          "finish_reason": {"type": choice["finish_reason"]}, "weight_version": None}}


class VLLMClient(SGLangClient):
    """One vLLM server; the same retries, timeouts and concurrency bound as ``SGLangClient``."""

    async def generate(self, input_ids: list[int], sampling_params: dict, *, return_logprob: bool = True,
                       logprob_start_len: int = -1, **extra) -> dict:
        """One sample (``logprob_start_len`` -1), or a prefill score from position ``logprob_start_len`` on (its
        ``input_token_logprobs``); routed experts are not asked of vLLM here."""
        if not return_logprob or extra or (input_ids and isinstance(input_ids[0], list)):
            raise ValueError("VLLMClient.generate: one prompt, with log-probs, without routed experts")
        if not -1 <= logprob_start_len < max(len(input_ids), 1):
            raise ValueError(f"VLLMClient.generate: logprob_start_len {logprob_start_len} outside the prompt "
                             f"({len(input_ids)} tokens)")
        scored = logprob_start_len >= 0
        resp = await self._request("POST", "/v1/completions", completion_request(input_ids, sampling_params, scored))
        answer = to_sglang_answer(resp, self.url)
        if scored:
            answer["meta_info"]["input_token_logprobs"] = input_token_logprobs(resp, input_ids, logprob_start_len,
                                                                               self.url)
        return answer
