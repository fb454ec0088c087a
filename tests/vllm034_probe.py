"""What tests/test_vllm034.py asks vLLM 0.34.0 itself, run by an interpreter that has it
(``$EAGLE3PIPE_VLLM034_PYTHON``, made as docs/development.md says: the GPU wheel with a CPU torch; no GPU, no server).

    python tests/vllm034_probe.py cli IN.json OUT.json      (with VLLM_TARGET_DEVICE=cpu: vLLM's CLI needs a device)
    python tests/vllm034_probe.py engine IN.json OUT.json   (no VLLM_TARGET_DEVICE: vLLM's configs on no platform)

IN.json holds what our code builds (the test writes it from the project's environment); OUT.json what vLLM's own
classes made of it. ``cli``: each server command our launcher, 05 and the recipe give, parsed by vLLM's own parser
into its engine arguments, its model and speculative configs; the commands the pages show, parsed; each server's
environment through vLLM's environment check; 01b's, 02's and 05's request bodies through vLLM's request models
into sampling parameters; a response's per-request speculative-decoding counters as vLLM builds them. ``engine``:
stage 02's connector (eagle3pipe.vllm_connector) built from 02's own --speculative-config and --kv-transfer-config
into a VllmConfig, its hidden-state cache planned, laid out and allocated by vLLM's own functions, filled by vLLM's
own cache writer, and driven through the scheduler and worker calls vLLM makes for real Request objects made from
02's request bodies (one per layout vLLM may choose); the /metrics text vLLM's Prometheus logger writes for a draft's
counters and decode timings.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import sys
import time
import traceback


def parse_command(argv: list[str]):
    """A server command as vLLM 0.34 reads it: ``serve MODEL ...`` as `vllm serve`, else our launcher's
    ``python -m vllm.entrypoints.openai.api_server`` arguments (entry.py's main: the same parser)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if argv[:1] == ["serve"]:
        parser = FlexibleArgumentParser()
        ServeSubcommand().subparser_init(parser.add_subparsers(dest="subcommand"))
        args = parser.parse_args(argv)
        args.model = args.model_tag or args.model
    else:
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    return args


def spec_keys_unknown(spec: dict) -> list[str]:
    from vllm.config import SpeculativeConfig

    return sorted(set(spec) - {f.name for f in dataclasses.fields(SpeculativeConfig)})


def command_result(argv: list[str], build: bool) -> dict:
    """What vLLM makes of one command: its engine arguments, model and speculative configs (``build``), or only its
    parsed arguments."""
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = parse_command(argv)
    if not build:  # a page's command: its model folder is not here, which the engine arguments would look up
        return {"tensor_parallel_size": args.tensor_parallel_size, "trust_remote_code": args.trust_remote_code,
                "speculative_config": args.speculative_config,
                "unknown_spec_keys": spec_keys_unknown(args.speculative_config or {})}
    ea = AsyncEngineArgs.from_cli_args(args)
    out = {"model": ea.model, "speculative_config": ea.speculative_config,
           "kv_transfer_config": ({k: v for k, v in dataclasses.asdict(ea.kv_transfer_config).items()
                                   if k != "engine_id"} if ea.kv_transfer_config else None),  # engine_id: a uuid
           "per_request_spec_decode_metrics": ea.per_request_spec_decode_metrics,
           "gpu_memory_utilization": ea.gpu_memory_utilization, "enable_prefix_caching": ea.enable_prefix_caching,
           "enable_chunked_prefill": ea.enable_chunked_prefill, "max_model_len": ea.max_model_len,
           "dtype": str(ea.dtype), "tensor_parallel_size": ea.tensor_parallel_size,
           "trust_remote_code": ea.trust_remote_code, "reasoning_parser": getattr(args, "reasoning_parser", None),
           "served_model_name": ea.served_model_name, "enforce_eager": ea.enforce_eager,
           "unknown_spec_keys": spec_keys_unknown(ea.speculative_config or {})}
    mc = ea.create_model_config()
    sc = ea.create_speculative_config(mc, ParallelConfig())
    out["architectures"] = mc.architectures
    if sc is not None:
        out["speculative"] = {
            "method": sc.method, "speculator_config": type(sc.speculator_config).__name__,
            "num_speculative_tokens": sc.num_speculative_tokens,
            "draft_architectures": list(getattr(sc.draft_model_config, "architectures", None) or []),
            "draft_model": getattr(sc.draft_model_config, "model", None),
            "attention_backend": sc.attention_backend.name if sc.attention_backend else None,
            "aux_layer_ids": list(getattr(sc.draft_model_config.hf_config, "eagle_aux_hidden_state_layer_ids",
                                          None) or []),
            "uses_aux_hidden_states": sc.uses_aux_hidden_states}
    return out


def environ_result(env: dict[str, str]) -> str:
    """vLLM's own check of a server's environment (EngineArgs.create_engine_config runs it first): "ok" or its
    error."""
    from vllm.platforms import current_platform

    saved = dict(os.environ)
    os.environ.update(env)
    try:
        current_platform.validate_environ(hard_fail=False)
        return "ok"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        os.environ.clear()
        os.environ.update(saved)


def request_result(kind: str, body: dict) -> dict:
    """A request body through vLLM's own request model: the fields it does not know (it ignores them with a
    warning) and the sampling parameters it makes."""
    if kind == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as Model
    else:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest as Model
    req = Model.model_validate(body)
    sp = req.to_sampling_params(max_tokens=body.get("max_completion_tokens") or body.get("max_tokens") or 16,
                                default_sampling_params={})
    return {"unknown_fields": sorted((req.model_extra or {}).keys()),
            "chat_template_kwargs": getattr(req, "chat_template_kwargs", None),
            "return_token_ids": getattr(req, "return_token_ids", None),
            "sampling": {"max_tokens": sp.max_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
                         "seed": sp.seed, "prompt_logprobs": sp.prompt_logprobs,
                         "spaces_between_special_tokens": sp.spaces_between_special_tokens,
                         "skip_special_tokens": sp.skip_special_tokens, "extra_args": sp.extra_args}}


def spec_metrics_result(steps: list[list[int]], k: int) -> dict:
    """A response's ``metrics.speculative_decoding`` as vLLM 0.34 builds it from verify steps (drafted, accepted)."""
    from vllm.entrypoints.generate.base.protocol import PerRequestMetrics, SpeculativeDecodingMetrics
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

    acc = RequestSpecDecodeMetrics.new(k)
    for drafted, accepted in steps:
        acc.observe(drafted, accepted)
    metrics = PerRequestMetrics(speculative_decoding=SpeculativeDecodingMetrics(**acc.to_dict()))
    return json.loads(metrics.model_dump_json(exclude_none=True))


def run_cli(inp: dict) -> dict:
    out: dict = {"vllm": __import__("vllm").__version__, "commands": {}, "pages": {}, "environ": {}, "requests": {}}
    for name, argv in inp["commands"].items():
        out["commands"][name] = command_result(argv, build=True)
    for where, argv in inp["pages"]:
        try:
            out["pages"][where] = command_result(argv, build=False)
        except BaseException as e:  # argparse exits: the command does not parse
            out["pages"][where] = {"error": f"{type(e).__name__}: {e}"}
    for name, env in inp["environ"].items():
        out["environ"][name] = environ_result(env)
    for name, (kind, body) in inp["requests"].items():
        out["requests"][name] = request_result(kind, body)
    out["spec_metrics"] = spec_metrics_result(inp["spec_steps"], inp["spec_k"])
    return out


# ---------------------------------------------------------------------------------------------------------------
# engine: the connector and /metrics


def target_specs(vc, sliding_window: int | None) -> dict:
    """The KV cache specs the verifier's own attention layers give (Attention / MLAAttention.get_kv_cache_spec: the
    layers themselves need a GPU attention backend to be built): one per layer, MLA as one latent of
    kv_lora_rank + qk_rope_head_dim; with ``sliding_window``, every other layer windowed (a hybrid verifier)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    mc, bs = vc.model_config, vc.cache_config.block_size
    text = mc.hf_text_config
    if getattr(text, "kv_lora_rank", None):
        spec = MLAAttentionSpec(block_size=bs, num_kv_heads=1, max_tp_shards=1, dtype=mc.dtype,
                                head_size=text.kv_lora_rank + text.qk_rope_head_dim, cache_dtype_str="auto")
    else:
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=mc.get_num_kv_heads(vc.parallel_config),
                                 head_size=mc.get_head_size(), dtype=mc.dtype)
    out = {f"model.layers.{i}.self_attn.attn": spec for i in range(mc.get_num_layers(vc.parallel_config))}
    if sliding_window:
        windowed = SlidingWindowSpec(block_size=bs, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                                     dtype=spec.dtype, sliding_window=sliding_window)
        out.update({name: windowed for name in list(out)[::2]})
    return out


def extraction_config(run: dict):
    """02's server as vLLM 0.34 builds it: model, speculative and KV-transfer configs from 02's own flag values; the
    hidden-state layer ExtractHiddenStatesModel registers beside the verifier's attention layers; the cache planned
    (the KV cache groups: the hidden states join a verifier's group of the same type, else get one of their own with
    its block size fitted to the verifier's page), laid out (from the layouts a worker reports and the one our
    connector asks for) and allocated by vLLM's functions."""
    import torch
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             SpeculativeConfig, VllmConfig, set_current_vllm_config)
    from vllm.distributed.parallel_state import initialize_model_parallel, model_parallel_is_initialized
    from vllm.model_executor.models.extract_hidden_states import ExtractHiddenStatesModel
    from vllm.v1.attention.backends.utils import _DEFAULT_LAYOUT_PREFERENCE, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.worker.utils import allocate_kv_cache

    mc = ModelConfig(model=run["verifier"], tokenizer=run["verifier"], dtype=run["dtype"],
                     max_model_len=run["max_model_len"], trust_remote_code=run["trust_remote_code"])
    pc = ParallelConfig()
    sc = SpeculativeConfig(**json.loads(run["speculative_config"]), target_model_config=mc, target_parallel_config=pc)
    kv = KVTransferConfig(**json.loads(run["kv_transfer_config"]))
    vc = VllmConfig(model_config=mc, cache_config=CacheConfig(), parallel_config=pc, speculative_config=sc,
                    kv_transfer_config=kv, device_config=DeviceConfig(device="cpu"))
    # the hybrid KV cache manager on, as CUDA's platform decides with a connector that supports it (ours does); no
    # platform here has it
    vc.scheduler_config.disable_hybrid_kv_cache_manager = False
    with set_current_vllm_config(vc):
        if not model_parallel_is_initialized():  # one process, one rank (gloo, loopback): TP rank 0 writes
            initialize_model_parallel(1, 1, backend="gloo")
        ExtractHiddenStatesModel(vllm_config=vc, prefix="drafter")
    layers = {n: layer for n, layer in vc.compilation_config.static_forward_context.items()
              if hasattr(layer, "get_kv_cache_spec")}
    specs = target_specs(vc, run["sliding_window"]) | {n: layer.get_kv_cache_spec(vc) for n, layer in layers.items()}
    # "default": what a worker reports when its attention backends declare no layout
    names = [m.name for m in _DEFAULT_LAYOUT_PREFERENCE] if run["layouts"] == "default" else run["layouts"]
    layout = resolve_kv_cache_layout(vc, [names], specs.values())
    (kcc,) = get_kv_cache_configs(vc, [specs], [run["cache_bytes"]], get_global_kv_cache_groups(vc, [specs]))
    caches = allocate_kv_cache(kcc, torch.device("cpu"), layout)
    return vc, kcc, layout, caches


def run_connector(run: dict, out_dir: str) -> dict:
    """Our connector through the calls vLLM's scheduler and worker make, for 02's requests: scheduled (the worker
    takes each file's lock), their states written into the cache by vLLM's own writer (saved beside, for the test
    to compare), finished (the scheduler delays the blocks' release and names the file), written (the worker copies
    the rows out and writes); a request naming a path outside the storage folder refused; one aborted before it was
    scheduled saving nothing."""
    import torch
    from safetensors.torch import save_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.model_executor.models.extract_hidden_states import basic_cache
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.request import Request, RequestStatus

    from eagle3pipe.vllm_connector import Eagle3HiddenStatesConnector

    vc, kcc, layout, caches = extraction_config(run)
    with set_current_vllm_config(vc):
        scheduler = Eagle3HiddenStatesConnector(vc, KVConnectorRole.SCHEDULER, kcc)
        worker = Eagle3HiddenStatesConnector(vc, KVConnectorRole.WORKER, kcc)
        worker.register_kv_caches(caches)
    cache = worker._kv_cache  # the hidden-state layer's view (the verifier's layers are not the connector's)
    group, block_size = scheduler._cache_kv_group_id, scheduler._block_size
    groups = kcc.kv_cache_groups
    res = {"layout": layout.name, "cache_shape": list(cache.shape), "cache_stride": list(cache.stride()),
           "cache_dtype": str(cache.dtype), "block_size": block_size, "block_dim": worker._block_dim,
           "num_blocks": kcc.num_blocks, "groups": [[type(g.kv_cache_spec).__name__, g.kv_cache_spec.block_size,
                                                     len(g.layer_names)] for g in groups],
           "hidden_group": group, "hidden_layer_in_it": worker.cache_layers[0] in groups[group].layer_names,
           "target_block_size": vc.cache_config.block_size, "requests": {}}

    def tables(blocks: list[int]) -> tuple[list[int], ...]:  # one block table per group; the verifier's unused
        return tuple(blocks if g == group else [] for g in range(len(groups)))

    def schedule(new: list) -> SchedulerOutput:
        return SchedulerOutput(
            scheduled_new_reqs=[NewRequestData.from_request(r, tables(blocks), list(r.prompt_token_ids))
                                for r, blocks in new],
            scheduled_cached_reqs=CachedRequestData.make_empty(),
            num_scheduled_tokens={r.request_id: len(r.prompt_token_ids) for r, _ in new},
            total_num_scheduled_tokens=sum(len(r.prompt_token_ids) for r, _ in new),
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
            free_encoder_mm_hashes=[])

    def step(output: SchedulerOutput) -> None:  # the worker's side of one step (kv_connector.py's pre/post_forward)
        worker.bind_connector_metadata(scheduler.build_connector_meta(output))
        worker.wait_for_save()

    requests, next_block = [], 1  # block 0 is vLLM's null block
    for item in run["requests"]:
        body = item["body"]
        sp = CompletionRequest.model_validate(body).to_sampling_params(max_tokens=1, default_sampling_params={})
        req = Request(item["id"], body["prompt"], sp, None)
        n_blocks = -(-len(body["prompt"]) // block_size)
        blocks = list(range(next_block + n_blocks - 1, next_block - 1, -1))  # descending: the order matters
        next_block += n_blocks
        requests.append((req, blocks, item["scheduled"]))
    scheduled = [(r, b) for r, b, sched in requests if sched]
    step(schedule(scheduled))
    gen = torch.Generator().manual_seed(0)
    states = {}
    for req, blocks in scheduled:
        t = len(req.prompt_token_ids)
        slots = torch.tensor([blocks[i // block_size] * block_size + i % block_size for i in range(t)])
        states[req.request_id] = (torch.randn(t, cache.shape[1], cache.shape[3], generator=gen) * 3).to(cache.dtype)
        basic_cache(states[req.request_id], cache, slots)  # what CacheOnlyAttentionImpl.do_kv_cache_update does
    worker.clear_connector_metadata()
    save_file({k: v.contiguous() for k, v in states.items()}, os.path.join(out_dir, "reference.safetensors"))
    for req, blocks, sched in requests:  # a request never scheduled has no block table
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, params = scheduler.request_finished_all_groups(req, tables(blocks) if sched else ())
        res["requests"][req.request_id] = {"delay_free": delay, "kv_transfer_params": params,
                                           "path": (req.kv_transfer_params or {}).get("hidden_states_path")}
    step(schedule([]))
    done, _ = worker.get_finished({r.request_id for r, _, _ in requests})
    worker.clear_connector_metadata()
    res["finished_sending"] = sorted(done or [])
    for info in res["requests"].values():  # wait for each write as stage 02's client does: a shared lock
        lock = (info["path"] or "") + ".lock"
        if os.path.exists(lock):
            with open(lock) as fh:
                fcntl.flock(fh, fcntl.LOCK_SH)
    return res


def run_metrics(inp: dict) -> str:
    """The /metrics text vLLM 0.34's Prometheus logger writes after one draft server's steps."""
    from prometheus_client import REGISTRY, generate_latest
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig
    from vllm.v1.engine import FinishReason
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    m = inp["metrics"]
    mc = ModelConfig(model=inp["verifier"], tokenizer=inp["verifier"], max_model_len=m["max_model_len"])
    pc = ParallelConfig()
    sc = SpeculativeConfig(**json.loads(m["speculative_config"]), target_model_config=mc, target_parallel_config=pc)
    vc = VllmConfig(model_config=mc, parallel_config=pc, speculative_config=sc,
                    device_config=DeviceConfig(device="cpu"))
    logger = PrometheusStatLogger(vc, engine_indexes=[0])
    stats = SpecDecodingStats.new(sc.num_speculative_tokens)
    for drafted, accepted in m["steps"]:
        stats.observe_draft(drafted, accepted)
    it = IterationStats()
    it.num_generation_tokens = m["generation_tokens"]
    it.inter_token_latencies_iter = list(m["inter_token_latencies"])
    it.finished_requests = [FinishedRequestStats(FinishReason.LENGTH, num_generation_tokens=m["generation_tokens"],
                                                 mean_time_per_output_token=t) for t in m["tpot"]]
    logger.record(SchedulerStats(spec_decoding_stats=stats), it, engine_idx=0)
    return generate_latest(REGISTRY).decode()


def run_engine(inp: dict, out_dir: str) -> dict:
    from vllm.distributed.parallel_state import init_distributed_environment

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{inp['port']}")
    out: dict = {"vllm": __import__("vllm").__version__, "connector": {}}
    for name, run in inp["connector_runs"].items():
        os.makedirs(os.path.join(out_dir, name))
        out["connector"][name] = run_connector(run, os.path.join(out_dir, name))
    out["metrics_text"] = run_metrics(inp)
    return out


def main() -> int:
    phase, inp_path, out_path = sys.argv[1:4]
    inp = json.loads(open(inp_path).read())
    t0 = time.monotonic()
    try:
        out = run_cli(inp) if phase == "cli" else run_engine(inp, os.path.dirname(out_path))
    except BaseException:
        out = {"error": traceback.format_exc()}
    out["seconds"] = round(time.monotonic() - t0, 1)
    with open(out_path, "w") as f:
        json.dump(out, f, default=str)
    return 0 if "error" not in out else 1


if __name__ == "__main__":
    sys.exit(main())
