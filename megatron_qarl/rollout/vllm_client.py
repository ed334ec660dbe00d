"""The rollout manager's requests to a vLLM 0.32 server, in vLLM's own API: ``VLLMClient.generate`` takes what
``SGLangClient.generate`` takes (token ids and the manager's SGLang sampling params) and answers in SGLang's
/generate shape, so the rollout manager, its failover and re-sends are the same for every backend.

One sample is one POST /v1/completions (vllm/entrypoints/openai/completion/protocol.py ``CompletionRequest``):
    prompt: the token ids; max_tokens, temperature, top_p, top_k, stop_token_ids, seed: the sample's sampling
    params (SGLang's ``max_new_tokens``, ``sampling_seed``); logprobs 0: the sampled token's log-prob only;
    return_token_ids: the response's token ids (``choices[0].token_ids``, the stop token included).
The log-probs are of the temperature-scaled logits because the server runs with
``--logprobs-mode processed_logprobs`` (rollout/vllm_launcher.py), as SGLang's and our engine's are.
Answer -> SGLang's ``meta_info``: ``output_token_logprobs`` [[logprob, token id, null], ...],
``finish_reason.type`` "stop" / "length" (vLLM's "abort" is a server failure: the manager re-sends the sample),
``weight_version`` the server's at answer time is not in vLLM's answer (None).
"""

from __future__ import annotations

from megatron_qarl.rollout.client import RolloutServerError, SGLangClient

# SGLang sampling param -> vLLM CompletionRequest field (the others are refused: the manager sends only these)
_PARAMS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "max_new_tokens": "max_tokens",
           "stop_token_ids": "stop_token_ids", "sampling_seed": "seed"}


def completion_request(input_ids: list[int], sampling_params: dict) -> dict:
    """The /v1/completions body of one sample."""
    unknown = sorted(set(sampling_params) - set(_PARAMS))
    if unknown:
        raise ValueError(f"sampling params {unknown} have no vLLM completion field here (known: {sorted(_PARAMS)})")
    body = {_PARAMS[k]: v for k, v in sampling_params.items()}
    return {"prompt": list(input_ids), "logprobs": 0, "return_token_ids": True, "echo": False, "n": 1,
            "skip_special_tokens": False, **body}


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
        if not return_logprob or extra or logprob_start_len != -1 or (input_ids and isinstance(input_ids[0], list)):
            raise ValueError("VLLMClient.generate: one prompt, with the response's log-probs only (routed experts "
                             "and prompt log-probs are not asked of vLLM here)")
        resp = await self._request("POST", "/v1/completions", completion_request(input_ids, sampling_params))
        return to_sglang_answer(resp, self.url)
