"""Weight sync from a sharded learner to a real `qarl serve` process over a gloo broadcast group."""

from __future__ import annotations

import httpx
import pytest
import torch

from megatron_qarl.config import OptimConfig, ParallelConfig
from megatron_qarl.learner.rank import Batch, Learner, token_mean_nll
from megatron_qarl.moe.model import Qwen3MoeArch
from megatron_qarl.moe.parallelize import barrier, free_port, init_parallel, run_ranks
from megatron_qarl.moe.verify import world_size
from megatron_qarl.qat.config import QuantConfig
from megatron_qarl.qat.export import quantize_checkpoint
from megatron_qarl.rollout.process import ServerProcess, embedded_command
from megatron_qarl.serve.weight_receiver import OUTSIDE_SESSION
from megatron_qarl.sync import weight_update as weight_update_mod
from megatron_qarl.sync.broadcaster import DistributedBroadcaster, Engine, SyncError

pytestmark = pytest.mark.multiproc


def start_server(model_dir: str, log_path, port: int | None = None) -> ServerProcess:
    port = port or free_port()
    server = ServerProcess(embedded_command(model_dir, port, dtype="float32"), f"http://127.0.0.1:{port}", log_path,
                           env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=120)
    server.start()
    return server


@pytest.fixture
def w4a16_server(tiny_model_dir, tmp_path):
    qdir = tmp_path / "w4a16"
    quantize_checkpoint(tiny_model_dir, "w4a16", qdir)
    server = start_server(str(qdir), tmp_path / "server.log")
    yield server
    server.stop()


def _sync_then_score(model_dir: str, tp: int, ep: int, url: str, aligned: bool) -> dict | None:
    import torch.distributed as dist

    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(tp=tp, ep=ep, seed=11)
    learner = Learner(arch, ParallelConfig(tp=tp, ep=ep), OptimConfig(lr=3e-3),
                      quant=QuantConfig(scheme="w4a16"), aligned=aligned)
    learner.load_hf(model_dir)
    # one update, so the server's start checkpoint is stale until the sync lands
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, arch.vocab_size, (4, 24), generator=gen)
    mask = torch.ones(4, 23)
    learner.train_step(Batch(tokens, mask), lambda lp, b: token_mean_nll(lp, b, int(mask.sum())))
    sync = DistributedBroadcaster([Engine(url)], dtype=torch.float32, verify=True, bucket_bytes=1 << 20)
    report = sync.sync(learner)
    box = [None]
    if dist.get_rank() == 0:
        prompt = [int(t) for t in tokens[0, :10]]
        resp = httpx.post(url + "/generate", json={
            "input_ids": prompt, "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 16, "sampling_seed": 7}}, timeout=60).json()
        triples = resp["meta_info"]["output_token_logprobs"]
        box = [(prompt, [t[1] for t in triples], [t[0] for t in triples], resp["meta_info"]["weight_version"])]
    dist.broadcast_object_list(box, src=0)
    prompt, response, sampler_logp, version = box[0]
    logp = learner.forward_logprobs(torch.tensor([prompt + response]))[0, len(prompt) - 1:]
    diff = (logp - torch.tensor(sampler_logp)).abs()
    sync.close()
    if dist.get_rank() != 0:
        return None
    return {"max_abs": diff.max().item(), "mean_abs": diff.mean().item(), "tokens": len(response),
            "version": version, "report": report}


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2)])
def test_sync_then_server_logprobs_equal_the_aligned_learner(tp, ep, tiny_model_dir, w4a16_server):
    url = w4a16_server.url
    out = run_ranks(world_size(tp, ep), _sync_then_score, tiny_model_dir, tp, ep, url, True)[0]
    print(f"\ntp={tp} ep={ep}: aligned W4A16 learner vs W4A16 server: max |dlogp| {out['max_abs']:.2e}, "
          f"mean {out['mean_abs']:.2e} over {out['tokens']} tokens; sync {out['report'].bytes} B in "
          f"{out['report'].seconds:.2f} s, {out['report'].buckets} buckets")
    assert out["report"].checksums and out["version"] == "v1"  # verify mode passed: checksums equal
    assert out["tokens"] > 0 and out["max_abs"] <= 1e-4


def test_bf16_learner_against_w4a16_server_reports_the_mismatch(tiny_model_dir, w4a16_server):
    url = w4a16_server.url
    out = run_ranks(1, _sync_then_score, tiny_model_dir, 1, 1, url, False)[0]
    print(f"\nunaligned fp32 learner vs W4A16 server: max |dlogp| {out['max_abs']:.2e}, mean {out['mean_abs']:.2e}")
    assert out["max_abs"] > 1e-3  # the quantization the learner does not see


def test_server_killed_during_a_sync_fails_naming_it_and_a_restarted_one_joins(tiny_model_dir, w4a16_server,
                                                                               tmp_path):
    server = w4a16_server
    url = server.url

    def body():  # world size 1 runs in this process, so it can kill and restart the server
        arch = Qwen3MoeArch.from_model_dir(tiny_model_dir)
        init_parallel()
        learner = Learner(arch, ParallelConfig(), OptimConfig(), quant=QuantConfig(scheme="w4a16"))
        learner.load_hf(tiny_model_dir)
        killer = DistributedBroadcaster([Engine(url)], dtype=torch.float32, bucket_bytes=64 << 10,
                                        progress=lambda buckets, _: server.proc.kill() if buckets == 2 else None)
        with pytest.raises(SyncError, match=url.replace(".", r"\.")) as failure:
            killer.sync(learner)
        killer.close()
        server.proc.wait(timeout=60)
        server.start()  # the same command: the same port
        report = DistributedBroadcaster([Engine(url)], dtype=torch.float32, verify=True, group_name="second",
                                        ).sync(learner)
        return str(failure.value), report

    message, report = run_ranks(1, body)[0]
    print(f"\nsync to a killed server (between begin and end): {message[:200]}")
    assert report.checksums and report.buckets == 1


def test_sync_follows_sglang_session_order_and_a_client_without_session_fails_as_on_sglang(
        tiny_model_dir, w4a16_server, monkeypatch):
    """pause -> flush -> begin -> buckets -> end -> continue, against `qarl serve`; a broadcaster that skips
    begin_weight_update is refused with SGLang's 400 and words, and leaves no broadcast pending."""
    import time

    url = w4a16_server.url
    calls: list[str] = []
    real_post = httpx.post

    def recording_post(target, *args, **kwargs):
        calls.append(target.removeprefix(url))
        return real_post(target, *args, **kwargs)

    monkeypatch.setattr(weight_update_mod.httpx, "post", recording_post)

    def body():
        arch = Qwen3MoeArch.from_model_dir(tiny_model_dir)
        init_parallel()
        learner = Learner(arch, ParallelConfig(), OptimConfig(), quant=QuantConfig(scheme="w4a16"))
        learner.load_hf(tiny_model_dir)
        sync = DistributedBroadcaster([Engine(url)], dtype=torch.float32, verify=True, bucket_bytes=256 << 10)
        report = sync.sync(learner)
        sync.close()
        order = list(calls)
        calls.clear()
        forgetful = DistributedBroadcaster([Engine(url)], dtype=torch.float32, group_name="forgetful")
        forgetful.apis[0].begin_weight_update = lambda: {"success": True}  # the client mistake: no session
        start = time.monotonic()
        with pytest.raises(SyncError) as refused:
            forgetful.sync(learner)
        took = time.monotonic() - start
        forgetful.close()
        return report, order, str(refused.value), took, list(calls)

    report, order, refused, took, after = run_ranks(1, body)[0]
    buckets = order.count("/update_weights_from_distributed")
    assert report.buckets == buckets > 1
    assert order == ["/init_weights_update_group", "/pause_generation", "/flush_cache", "/begin_weight_update",
                     *["/update_weights_from_distributed"] * buckets, "/end_weight_update", "/continue_generation",
                     "/weights_checker", "/destroy_weights_update_group"]
    print(f"\nrefused without a session in {took:.2f} s: {refused[:240]}")
    assert url in refused and OUTSIDE_SESSION in refused and "HTTP 400" in refused
    assert took < 30  # the abandoned broadcast ended with the group, not at gloo's 300 s timeout
    assert "/destroy_weights_update_group" in after


def test_a_bounded_sync_that_fails_continues_generation_so_no_request_waits_on_a_paused_server(tiny_model_dir,
                                                                                                  w4a16_server):
    """train.async=bounded pauses the servers with mode retract: running requests stay there, parked, and so do
    requests sent during the sync. A sync that fails after the pause must continue generation before it raises;
    without that (main before issue 29) they waited until their client's timeout (rollout.timeout_s x retries),
    and the trainer's shutdown waited on them."""
    import threading
    import time

    from megatron_qarl.sync import broadcaster as broadcaster_mod

    url = w4a16_server.url

    def body():
        answer: dict = {}
        request = threading.Thread(target=lambda: answer.update(httpx.post(url + "/generate", json={
            "input_ids": [2, 19, 20, 6, 15], "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 3}},
            timeout=120).json()),
            daemon=True)
        sync = DistributedBroadcaster([Engine(url)], dtype=torch.float32, pause_mode="retract")

        def failing_session(*_args, **_kwargs):  # the servers are paused: a request arrives, then a bucket fails
            request.start()
            time.sleep(2.0)
            raise SyncError(f"{url}/update_weights_from_distributed: refused (the test's failure)")

        sync.transport.session = failing_session
        real_payload = broadcaster_mod.iter_sync_tensors
        broadcaster_mod.iter_sync_tensors = lambda *_args, **_kwargs: iter(())
        try:
            with pytest.raises(SyncError, match="the test's failure"):
                sync.sync(learner=None)
        finally:
            broadcaster_mod.iter_sync_tensors = real_payload
        failed_at = time.monotonic()
        request.join(timeout=60)
        sync.close()
        return not request.is_alive(), time.monotonic() - failed_at, answer

    done, waited, answer = run_ranks(1, body)[0]
    print(f"\nthe parked request finished {waited:.2f} s after the failed sync")
    assert done, "a request parked on the paused server was still waiting 60 s after the failed sync"
    assert len(answer["meta_info"]["output_token_logprobs"]) == 8


def test_a_failing_continue_on_the_first_server_still_continues_the_second(monkeypatch):
    """After a successful update the sync continues every paused server, collects the failures, then raises
    naming them: before issue 38 the first server's failing /continue_generation left the ones after it paused
    (bounded mode's retracted requests there waited out rollout.timeout_s x retries)."""
    from megatron_qarl.sync import broadcaster as broadcaster_mod

    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    sync = DistributedBroadcaster([Engine(u) for u in urls], dtype=torch.float32, pause_mode="retract")
    calls: list[tuple[str, str]] = []

    def recorder(api, name, fails=False):
        def call(*_args, **_kwargs):
            calls.append((api.url, name))
            if fails:
                raise SyncError(f"{api.url}/{name}: HTTP 503: the test's failure")
        return call

    for api in sync.apis:
        for name in ("pause_generation", "flush_cache"):
            setattr(api, name, recorder(api, name))
        api.continue_generation = recorder(api, "continue_generation", fails=api.url == urls[0])
    monkeypatch.setattr(sync, "connect", lambda: None)
    monkeypatch.setattr(sync.transport, "session", lambda *_args, **_kwargs: None)
    monkeypatch.setattr(broadcaster_mod, "iter_sync_tensors", lambda *_args, **_kwargs: iter(()))
    with pytest.raises(SyncError, match=r"127\.0\.0\.1:1/continue_generation: HTTP 503") as failure:
        sync.sync(learner=None)
    assert (urls[1], "continue_generation") in calls, "the second server was left paused"
    assert urls[1] not in str(failure.value)


def _nan_on_rank_one(model_dir: str, url: str) -> dict:
    import time

    import torch.distributed as dist

    from megatron_qarl.errors import UserError

    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(ep=2, seed=11)
    learner = Learner(arch, ParallelConfig(ep=2), OptimConfig(), quant=QuantConfig(scheme="w4a16"))
    learner.load_hf(model_dir)
    sync = DistributedBroadcaster([Engine(url)], dtype=torch.float32, bucket_bytes=1 << 20)
    sync.sync(learner)  # v1: the weights the servers must keep
    prompt = {"input_ids": [3, 9, 4, 12, 8], "sampling_params": {"temperature": 0.0, "max_new_tokens": 8}}
    before = httpx.post(url + "/generate", json=prompt, timeout=60).json()["output_ids"] \
        if dist.get_rank() == 0 else None
    expert = next(t for t in learner.fake_quant.targets if t.pm.split == "fc1")
    if dist.get_rank() == 1:
        with torch.no_grad():
            expert.param[0, 0] = float("nan")
    t0 = time.perf_counter()
    with pytest.raises(UserError) as refusal:
        sync.sync(learner)
    out = {"message": str(refusal.value), "seconds": time.perf_counter() - t0}
    if dist.get_rank() == 0:
        after = httpx.post(url + "/generate", json=prompt, timeout=60).json()
        out["version"], out["same_output"] = after["meta_info"]["weight_version"], after["output_ids"] == before
    sync.close()
    return out


def test_a_nan_on_one_expert_parallel_rank_fails_every_rank_alike_and_the_server_keeps_its_weights(
        tiny_model_dir, w4a16_server):
    """Issue 46 item 3: the NaN is in rank 1's weights only. Before, rank 1 raised inside the sync's collective loop
    and rank 0 blocked in the next gather (run_ranks' timeout ended it). Now every rank agrees on the weights'
    finiteness first, and both raise the same UserError naming the weight and the rank, within seconds."""
    out = run_ranks(2, _nan_on_rank_one, tiny_model_dir, w4a16_server.url, timeout=120)
    print(f"\nNaN on EP rank 1: {out[0]['message'][:300]} ({out[0]['seconds']:.2f} s / {out[1]['seconds']:.2f} s)")
    assert out[0]["message"] == out[1]["message"]
    assert "on learner rank 1" in out[0]["message"] and "on learner rank 0" not in out[0]["message"]
    assert "linear_fc1" in out[0]["message"] or "fc1" in out[0]["message"], out[0]["message"]
    assert max(o["seconds"] for o in out) < 30
    assert out[0]["version"] == "v1" and out[0]["same_output"]


def _slow_server_syncs(model_dir: str, url: str, server_pid: int, collective_s: float) -> dict:
    """TP2 learner (gloo) whose groups wait ``collective_s``; the server stops (SIGSTOP) at its first weight-update
    call of a sync for longer than that (rank 1 is then in the payload's next gather), first within the sync's bound,
    then past it."""
    import datetime
    import os
    import signal
    import threading
    import time

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_qarl.sync.weight_update import WeightUpdateAPI

    arch = Qwen3MoeArch.from_model_dir(model_dir)
    init_parallel(tp=2, seed=11, timeout_s=collective_s)
    for group in ps._global_process_group_list:  # as init_parallel sets them (before issue 53: whole minutes)
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=collective_s), group)
    learner = Learner(arch, ParallelConfig(tp=2), OptimConfig(), quant=QuantConfig(scheme="w4a16"))
    learner.load_hf(model_dir)
    real = WeightUpdateAPI.update_weights_from_distributed

    def server_stops_for(seconds: float) -> None:
        """Rank 0: at the next bucket's update call the server process stops for ``seconds`` (it neither receives
        the broadcast nor answers meanwhile), then goes on."""
        def stopped(api, *args, **kwargs):
            WeightUpdateAPI.update_weights_from_distributed = real
            os.kill(server_pid, signal.SIGSTOP)
            threading.Timer(seconds, os.kill, (server_pid, signal.SIGCONT)).start()
            return real(api, *args, **kwargs)
        if dist.get_rank() == 0:
            WeightUpdateAPI.update_weights_from_distributed = stopped

    # the trainer's driver waits for every rank's sync call before it starts the next (Ray): so do the ranks here
    driver = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=120))
    out = {}
    for case, stop_s, sync_s in (("within", 3 * collective_s, 6 * collective_s),
                                 ("past", 5 * collective_s, 2 * collective_s)):
        server_stops_for(stop_s)
        # 16 KiB buckets: the first holds the embedding alone, so rank 1 is in the next tensor's TP gather meanwhile
        sync = DistributedBroadcaster([Engine(url)], dtype=torch.float32, bucket_bytes=16 << 10, timeout_s=sync_s,
                                      group_name=f"wug-{case}")
        t0 = time.monotonic()
        try:
            report = sync.sync(learner)
            out[case] = ("ok", report.buckets if report else None, time.monotonic() - t0)
        except SyncError as err:
            out[case] = ("SyncError", str(err), time.monotonic() - t0)
        sync.close()
        barrier(driver)
    return out


def test_a_slow_server_fails_the_sync_by_its_own_bound_on_every_rank(tiny_model_dir, w4a16_server):
    """Issue 53 item 1. The ranks other than 0 wait in the sync's gathers while rank 0 talks to the servers; those
    gathers ran on the learner's groups (launch.collective_timeout_s), so a server slower than that bound but within
    rollout.sync.timeout_s killed the peer ranks with a collective timeout (the 30B configs: 300 s against 1800 s),
    and a server past the sync's bound raised the SyncError on rank 0 alone. Now the sync's collectives run on groups
    of their own (``sync_groups``, bound ``peer_wait_s``) and rank 0 broadcasts the outcome: here the learner's groups
    wait 2 s, the server stops for 6 s within a 12 s sync bound (the sync completes), then for 10 s past a 4 s bound
    (the same SyncError naming the server on both ranks, nothing left waiting)."""
    url = w4a16_server.url
    out = run_ranks(2, _slow_server_syncs, tiny_model_dir, url, w4a16_server.proc.pid, 2.0, timeout=300)
    for rank, cases in enumerate(out):
        print(f"\nrank {rank}: " + "; ".join(f"{case}: {r[0]} after {r[2]:.1f} s ({str(r[1])[:160]})"
                                          for case, r in cases.items()))
    rank0, rank1 = out
    assert rank0["within"][0] == rank1["within"][0] == "ok"
    assert rank0["within"][1] > 1 and rank1["within"][1] is None  # buckets sent: rank 1 waited between them
    assert rank0["within"][2] >= 6.0  # it did wait for the stopped server, longer than the collectives' 2 s
    assert rank0["past"][0] == rank1["past"][0] == "SyncError"
    assert rank0["past"][1] == rank1["past"][1]
    assert url in rank0["past"][1] and "rollout.sync.timeout_s=4 s" in rank0["past"][1], rank0["past"][1]
