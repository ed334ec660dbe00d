"""Names vulture reports as unused (tests/test_dead_code.py, 60% confidence) that are not dead code: entry points
called from outside the scanned code, protocol signatures, and fields of other libraries' objects or of request
bodies. One line per name: the name, where it stands, and who uses it. FastAPI routes (``@app.*``) and pydantic
validators (``@field_validator``, ``@model_validator``) are exempt in the test itself: their frameworks call them."""
# ruff: noqa: B018, F821

exc  # __exit__/__aexit__(self, *exc) of LocalSlurm, RewardScorer, SGLangClient: the context-manager protocol
frame  # data/reward.py on_alarm(signum, frame): the signal-handler signature
types  # megatron_cpu.py __torch_function__(self, func, types, ...): torch's TorchFunctionMode protocol
worker_main  # data/reward.py: a verification worker's entry point, started as `python -c "...worker_main(...)"`
worker_pids  # data/reward.py RewardScorer: the workers' pids, which the fault tests kill (tests/test_data_reward.py)
pids  # launch/ ServerFleet.pids (Protocol, local, Ray actor): the servers' pids, which the fault drills kill
sbatch  # launch/local_slurm.py LocalSlurm.sbatch: tests/test_slurm.py submits slurm/qarl.sbatch through it
pre_tokenizer  # data/tokenizer.py: a field of the `tokenizers` Tokenizer it builds (read by that library)
generation_config  # scripts/make_tiny_model.py: a transformers model field, written out by save_pretrained
__wrapped__  # megatron_cpu.py: the functools convention (inspect.unwrap) for the wrapped original of a fix
tie_word_embeddings  # moe/model.py Qwen3MoeArch: read from config.json and refused when true (from_hf_config)
prompt_text  # data/prompts.py PromptSample: the rendered prompt beside its ids (tests check the rendering)
int8_plain  # serve/kernels/native.py Kernels: binding of the C library's plain loop, the SIMD GEMV's reference in tests
kv_round  # numerics/native.py: binding of exact.c's qx_kv_round (the exact engine's attention block runs its row
# function), checked against torch's cast on every bf16 value in tests/test_kv_cache.py
selector  # serve/weight_receiver.py: a field of SGLang's weight-update request bodies, accepted so they validate
torch_empty_cache  # serve/weight_receiver.py: a field of SGLang's UpdateWeightsFromDistributedReqInput
allow_quant_error  # serve/weight_receiver.py: a field of SGLang's CheckWeightsReqInput
wait_stream  # simulated_device.py _Stream: torch.cuda.Stream's API, called by Megatron's grad buffers, dispatchers
wait_event  # simulated_device.py _Stream: torch.cuda.Stream's API, called by Megatron's token dispatchers
record_event  # simulated_device.py _Stream: torch.cuda.Stream's API, called by Megatron's dispatchers
elapsed_time  # simulated_device.py _Event: torch.cuda.Event's API, called by Megatron's timers
init_info_cls  # rollout/vllm_ext/qarl_vllm_ext.py: vLLM's WeightTransferEngine reads it (parse_init_info)
update_info_cls  # rollout/vllm_ext/qarl_vllm_ext.py: vLLM's WeightTransferEngine reads it (parse_update_info)
supports_draft_weight_update  # rollout/vllm_ext/qarl_vllm_ext.py: read by vLLM's worker (start_draft_weight_update)
init_transfer_engine  # rollout/vllm_ext/qarl_vllm_ext.py: vLLM's worker calls it (/init_weight_transfer_engine)
start_weight_update  # rollout/vllm_ext/qarl_vllm_ext.py: vLLM's worker calls it (/start_weight_update)
receive_weights  # rollout/vllm_ext/qarl_vllm_ext.py: vLLM's WeightTransferEngine.update_weights calls it
finish_weight_update  # rollout/vllm_ext/qarl_vllm_ext.py: vLLM's worker calls it (/finish_weight_update)
QarlWorkerExtension  # rollout/vllm_ext/qarl_vllm_ext.py: named by the vLLM server's --worker-extension-cls
RequireApiKey  # rollout/vllm_ext/qarl_vllm_auth.py: named by the vLLM server's --middleware (vLLM adds it to its app)
VLLM_VERSION  # rollout/vllm_launcher.py: the pinned vLLM; tests/test_vllm_contract.py checks the env and requirements
graphsafe_get_state  # simulated_device.py _Generator: torch.cuda's generator API (Megatron's RNG tracker)
graphsafe_set_state  # simulated_device.py _Generator: torch.cuda's generator API (Megatron's RNG tracker, CUDA graphs)
replace_function  # qat/modules.py register_backends: ModelOpt's plugins.custom calls it (our restoring version)
compile_variants  # qat/triton_refresh.py: the sm_90 compile check, run by tests/test_triton_refresh.py (python -c)
chunk_size  # megatron_cpu.py foreach_l2_norm / foreach_scale: amp_C.multi_tensor_* signatures (multi_tensor_applier)
noop_flag  # megatron_cpu.py foreach_l2_norm / foreach_scale: amp_C's overflow buffer argument, unused as Megatron's
dispatch_preprocess  # moe/dispatch.py: Megatron's MoELayer calls its token dispatcher's methods (ours override them)
token_dispatch  # moe/dispatch.py: called by Megatron's MoELayer.dispatch
dispatch_postprocess  # moe/dispatch.py: called by Megatron's MoELayer.routed_experts_compute
combine_preprocess  # moe/dispatch.py: called by Megatron's MoELayer.routed_experts_compute
token_combine  # moe/dispatch.py: called by Megatron's MoELayer.combine
async_finish  # moe/dispatch.py token_combine: Megatron's MoEAlltoAllTokenDispatcher.token_combine signature
allocate_on_comm_stream  # moe/dispatch.py token_combine: the same signature
hidden_shape_before_permute  # moe/dispatch.py: read by Megatron's combine_postprocess / combine_preprocess (unpermute)
__class__  # moe/dispatch.py sort_dispatch: a Megatron dispatcher becomes our subclass of it
tensor_model_parallel  # moe/grouped.py: Megatron's parameter attribute (param_is_not_tensor_parallel_duplicate)
partition_dim  # moe/grouped.py: Megatron's parameter attribute (set with tensor_model_parallel)
allreduce  # moe/grouped.py: Megatron's parameter attribute: DDP and the optimizer's expert-parallel grouping read it
backward_dw  # moe/grouped.py GroupedExperts: Megatron's MoE layer calls its experts' backward_dw (delayed wgrad)
attention_type  # moe/attention.py SDPAttention(...): Megatron's core-attention builder signature (CoreAttentionBuilder)
cp_comm_type  # moe/attention.py SDPAttention(...): Megatron's core-attention builder signature (context parallel 1)
