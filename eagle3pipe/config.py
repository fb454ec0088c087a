"""Typed configuration: one dataclass per stage plus a shared section, loaded from YAML, overridden by CLI flags.

A YAML file has one section per dataclass below (``shared``, ``prepare``, ``generate``, ``extract``, ``vocab``,
``train``, ``evaluate``). Precedence: CLI flag > YAML > default. Every field is a flag of the same name with dashes
(``max_completion_tokens`` -> ``--max-completion-tokens``). Unknown keys and wrong types are rejected at start with
the key named. Defaults are the Kimi-K2.5 values; ``configs/demo.yaml`` points the same fields at the toy verifier.

The comment on each field (and the comment lines right below it) is its description: ``field_docs`` reads it from
this file for every flag's ``--help`` (with the default), and for any reference generated from the config.
``server_args`` (01b, 02 and 04 online, 05) is one type, ``VllmArgs``: a list of vLLM flags; a string (YAML or each
``--server-args`` value) is split as a shell would. Flags that would move a started server off loopback or put a
secret in our logs (``RESERVED_SERVER_FLAGS``) are refused there, naming what to use instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
import shlex
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .records import REQUEST_ERROR_KINDS


REPORT_TO = ("tensorboard", "wandb")  # train.report_to's trackers


class ConfigError(ValueError):
    """A configuration problem, named precisely enough to fix it (key, file, flag)."""


# The type of every ``server_args``: vLLM flags for a server a stage starts, one word an item (the argv vLLM gets).
# YAML takes a list, or one string split as a shell would; on the command line each --server-args value is split
# that way and repeated flags add up.
VllmArgs = typing.NewType("VllmArgs", list)

# Flags of a server a stage starts that server_args may not set. vLLM keeps the last value of a flag and takes any
# unambiguous abbreviation (argparse's allow_abbrev) or underscores (--api_key), so each is matched that way.
_LOOPBACK = ("a server started here listens on 127.0.0.1 at a free port, so that no other machine reaches it (02's "
             "writes files where a request says)")
RESERVED_SERVER_FLAGS = {
    "--host": _LOOPBACK,
    "--port": _LOOPBACK,
    # what vLLM itself treats as secrets (it redacts these in its own log): ours would be logged and saved
    "--api-key": "a key there would be written to the stage's log, provenance.json and report.json: set $VLLM_API_KEY "
                 "instead (vLLM's own variable: a server started here then requires it, and every client of ours "
                 "sends it)",
    "--hf-token": "a token there would be written to the stage's log and provenance.json: set $HF_TOKEN in the "
                  "environment instead",
}
# where a server on another address or port is given instead, by the section whose server_args it is
SERVER_URL_FLAGS = {
    "generate": "start it yourself and pass its URL with --vllm-url",
    "extract": "start it yourself (its command: python -m eagle3pipe.extract_vllm --config FILE --host ADDR, with "
               "$VLLM_API_KEY set) and pass its URL with --extract-url",
    "evaluate": "start it yourself and pass its URL with --eval-url (and --baseline-url)",
}


def reserved_server_flag(word: str) -> str | None:
    """The reserved flag ``word`` sets in vLLM's parser (``--hos=x`` and ``--api_key`` included), else None."""
    if not word.startswith("--") or word == "--":
        return None
    name = "--" + word[2:].split("=", 1)[0].replace("_", "-")
    return next((flag for flag in RESERVED_SERVER_FLAGS if len(name) > 2 and flag.startswith(name)), None)


def _check_vllm_args(key: str, value, source: str) -> list[str]:
    """``value`` (a list of words, or one string split as a shell would) as vLLM's argv, refusing the reserved flags
    and an item that holds a flag and its value together."""
    if isinstance(value, str):
        try:
            value = shlex.split(value)
        except ValueError as e:  # an unclosed quote
            raise ConfigError(f"{source}: key '{key}': {e} in {value!r}") from None
    if isinstance(value, list):  # YAML reads the 8 of [--tensor-parallel-size, 8] as a number: its word is "8"
        value = [str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{source}: key '{key}' must be a list of vLLM flags (strings), got {value!r}")
    for i, word in enumerate(value):
        flag = reserved_server_flag(word)
        if flag is not None:
            section = key.split(".", 1)[0]
            fix = (f"; to serve on another address or port, {SERVER_URL_FLAGS[section]}"
                   if flag in ("--host", "--port") else "")
            raise ConfigError(f"{source}: {key}: {word.split('=', 1)[0]} is not allowed here: "
                              f"{RESERVED_SERVER_FLAGS[flag]}{fix}")
        if word.startswith("-") and re.match(r"-[^=\s]*\s", word):
            raise ConfigError(f"{source}: {key}[{i}] {word!r} holds a flag and its value in one item: give each word "
                              f"its own item ({', '.join(repr(w) for w in word.split())})")
    return list(value)


@dataclass
class SharedConfig:
    data_dir: str = "data"  # root folder under which every stage reads and writes (prepared/, synthetic/, ...)
    verifier: str = ""  # path of the target (verifier) model folder (HF layout; Kimi-K2.5 nested config accepted)
    tokenizer: str = ""  # tokenizer folder; empty = the verifier's folder
    think_token_id: int = 163606  # id of <think>; cross-checked against the tokenizer at start
    response_token_id: int = 163607  # id of </think> (start of the visible response); cross-checked likewise
    aux_layer_ids: list[int] = field(default_factory=lambda: [2, 30, 58])  # vLLM convention: state entering layer k.
    # What stage 02 captures (ascending, k >= 1); a draft reads these or the subset train.draft_layer_ids names (one
    # extraction of the union serves an EAGLE-3 and a DFlash draft)
    hidden_size: int = 7168  # verifier hidden size; cross-checked against the verifier config
    vocab_size: int = 163840  # verifier vocabulary size (lm_head rows)
    draft_vocab_size: int = 32000  # size of the draft's own vocabulary (top tokens by supervised frequency)
    max_seq_len: int = 32768  # tokens per sample, prompt + completion; longer rows are dropped (01) or flagged (01b).
    # Must be <= train.total_seq_len (checked at start): speculators cuts a longer sample to one packed row and never
    # trains the rest. Disk: 57 KB/token bf16 states for K2.5 (a 32768-token row = 1.9 GB; fp8 half)
    thinking: bool = True  # render prompts with thinking on (generation prompt ends with <think>)
    seed: int = 0  # seed for every random choice the stages make
    progress_every_s: float = 30.0  # seconds between plain progress lines when no terminal is attached
    vllm_url: list[str] = field(default_factory=list)  # base URL(s) of vLLM servers, e.g. http://host:8000 (no /v1)
    trust_remote_code: bool = True  # run the verifier folder's own code (the real K2.5 tokenizer is remote code):
    # for tokenizer and config loads here, and --trust-remote-code for the servers the stages start


@dataclass
class PrepareConfig:
    dataset: list[str] = field(default_factory=list)  # HF dataset ids or local .json/.jsonl/.parquet files
    dataset_split: str = "train"  # split read from HF datasets
    max_samples: int = 10000  # questions kept per dataset: a sample drawn with shared.seed when it has more; 0 = all
    truncation: str = "drop"  # rows longer than max_seq_len: "drop" (listed in errors.jsonl) or "truncate"
    overwrite: bool = False  # rewrite outputs made with a different config instead of refusing
    num_proc: int = 0  # processes that render and tokenize the rows; 0 = the CPU cores this process may use


@dataclass
class GenerateConfig:
    served_model_name: str = ""  # model name the vLLM server serves; empty = ask the server (/v1/models)
    concurrency: int = 128  # requests in flight at once, over all servers
    request_timeout_s: float = 1800.0  # per-request client timeout, seconds
    max_retries: int = 3  # retries after a timeout, connection error or 5xx, with exponential backoff
    max_samples: int = 10000  # questions taken from questions.jsonl (the first N; a rerun resumes them); 0 = all
    max_completion_tokens: int = 8192  # cap on reasoning + answer tokens per request
    min_completion_tokens: int = 50  # completions shorter than this are kept in responses but left out of data
    temperature: float = 1.0  # sampling temperature sent to the server (Moonshot's K2.5 thinking-mode value)
    top_p: float = 0.95  # nucleus sampling sent to the server (Moonshot's K2.5 thinking-mode value)
    include_truncated: bool = False  # also train on finish_reason length/abort/repetition records
    empty_reasoning_max_share: float = 0.05  # stop when clearly more than this share of responses lack reasoning
    allow_empty_reasoning: bool = False  # with thinking on, also train on responses whose reasoning came back empty
    retry_empty_reasoning: bool = False  # ask again the questions whose finished response has empty reasoning
    max_error_share: float = 0.0  # exit non-zero while more than this share of ids errored (a rerun retries them)
    permanent_error_kinds: list[str] = field(default_factory=list)  # error kinds accepted as final: context_too_long
    retry_backoff_s: float = 2.0  # wait before the first retry, seconds; doubled per retry, capped at 60
    request_extra_json: str = ""  # JSON object merged into every request body (vLLM extras: top_k, min_tokens, ...)
    overwrite: bool = False  # start afresh: delete synthetic/ responses, data, errors (e.g. after a bad server setup)
    server_args: VllmArgs = field(default_factory=list)  # no --vllm-url: start the verifier's server here with these
    # vLLM flags (empty = a URL is needed)
    server_start_timeout_s: float = 3600.0  # seconds to wait for that server to answer (K2.5 loads for tens of minutes)


@dataclass
class ExtractConfig:
    input: str = "synthetic"  # which rows to extract: "synthetic" (01b output) or "prepared" (01 output)
    backend: str = "transformers"  # "transformers" (the model in this process: small verifiers, the exact reference) or "vllm" (vLLM servers: K2.5's int4 kernels, TP in a node, a URL per node)
    extract_url: list[str] = field(default_factory=list)  # vllm: running extraction servers (repeatable, data parallel); empty = start one
    server_args: VllmArgs = field(default_factory=list)  # vllm: extra flags for the server this stage (or 04 online)
    # starts, e.g. --tensor-parallel-size 8
    server_start_timeout_s: float = 3600.0  # vllm: seconds to wait for a started server (K2.5 loads for tens of minutes)
    concurrency: int = 32  # vllm: requests in flight over all servers
    request_timeout_s: float = 600.0  # vllm: per-request client timeout, seconds
    max_retries: int = 3  # vllm: retries after a timeout, connection error, 5xx or a file that fails its check
    retry_backoff_s: float = 2.0  # vllm: wait before the first retry, seconds; doubled per retry
    max_error_share: float = 0.0  # vllm: exit non-zero while more than this share of rows is left open by
    # transient failures (a rerun retries them). 04: the share of an epoch's samples its read checks may skip. 04
    # online: a sample no server answers for after every retry always stops 04 (a checkpoint; --resume), whatever
    # this share
    verify_tokens: int = 2048  # vllm: tokens of the first samples whose next-token top-1 from the stored final state is checked against the server's prompt_logprobs before the bulk run; 0 = off
    verify_min_agreement: float = 0.99  # vllm: stop before the bulk run when that top-1 agreement is lower
    storage_dtype: str = "bf16"  # "bf16" (whatever model_dtype) or "fp8" (e4m3 values, one scale per token and state)
    batch_tokens: int = 16384  # padded tokens per forward batch (samples sorted by length)
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N"
    model_dtype: str = "bfloat16"  # dtype the verifier runs in
    force_disk: bool = False  # start even when the preflight says the output will not fit on disk
    num_workers: int = 0  # data-parallel worker processes, one per GPU, disjoint shards; 0 = one per visible GPU
    device_map: str = ""  # "" = whole verifier on each worker's device; "auto" = split layers over all GPUs (1 worker)
    writer_threads: int = 8  # background threads writing sample files (compute never waits on disk)
    max_pending_batches: int = 4  # batches computed but not yet written before the forward loop waits (memory cap)
    compile: bool = False  # torch.compile each decoder layer (GPU: fuses elementwise ops; the first batches compile)
    overwrite: bool = False  # delete an existing hidden_states/ made from other inputs/config instead of refusing


@dataclass
class VocabConfig:
    mask_token: str = "[UNK]"  # train.draft dflash: the name of the tokenizer's special token that fills a block's
    # draft slots (K2.5: [UNK] = 163838, z-lab's); resolved by name, refused if absent, not special or in the rows
    rebuild: bool = False  # with train.finetune_from: rebuild the map from our data instead of keeping the checkpoint's
    finetune_from: str = ""  # warm-start draft folder whose d2t/t2d are kept (or replaced with rebuild); empty = train.finetune_from


@dataclass
class TrainConfig:
    draft: str = "eagle3"  # "eagle3" (one layer, k drafts autoregressively), "eagle3_mla" (the same with the
    # verifier's MLA attention: DeepSeek-V3 / Kimi verifiers; vLLM's Eagle3DeepseekV2ForCausalLM) or "dflash" (a block
    # of k + 1 in one forward; speculators' DFlashDraftModel, vLLM method dflash). docs/mla.md: when to pick which
    draft_layer_ids: list[int] = field(default_factory=list)  # the states of shared.aux_layer_ids this draft reads
    # (an ascending subset; empty = all of them); EAGLE-3 reads exactly 3
    finetune_from: str = ""  # warm-start from an AQ-MedAI/SpecForge/TorchSpec-format draft folder (eagle3), an
    # Eagle3DeepseekV2ForCausalLM one (eagle3_mla: lightseekorg's MLA drafts, ours), or a z-lab or speculators DFlash
    # draft folder (dflash)
    epochs: int = 3  # passes over the training split
    learning_rate: float = 1e-4  # peak AdamW learning rate
    total_seq_len: int = 32768  # tokens packed per training row (one optimizer step); >= shared.max_seq_len.
    # K2.5 draft on one H200: peak 39.8 GiB at 8192, 80.7 GiB at 32768 (measured, docs/stages/04_train.md)
    ttt_steps: int = 3  # test-time-training unroll steps
    checkpoint_every: int = 500  # optimizer steps between checkpoints
    eval_fraction: float = 0.05  # share of samples held out for per-epoch evaluation (drawn with shared.seed from
    # the whole rows file, so rows ordered by source are judged on every source)
    max_samples: int = 0  # train on this many samples of the training split, 0 = all: a draw with shared.seed, each
    # N's samples holding every smaller N's; the held-out split stays the same, so drafts of 125, 500, 2000 samples of
    # one extraction are judged on the same rows (the data-volume curve, docs/sizing.md)
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N"
    resume: bool = False  # continue from the newest checkpoint in checkpoints/
    export_format: str = "eagle3"  # "eagle3" (flat LlamaForCausalLMEagle3; one file vLLM and SGLang both read right:
    # top-level aux ids for vLLM, eagle_config ids for SGLang) or "speculators" (speculators' format, vLLM)
    max_steps: int = 0  # stop after this many optimizer steps in total (the LR schedule still spans all epochs); 0 = no cap
    log_every: int = 10  # optimizer steps between metric lines in checkpoints/metrics.jsonl
    num_workers: int = 8  # data-loader worker processes reading hidden_states/ (0 = read in the training process)
    cpu_threads: int = 0  # torch threads when training on CPU (0 = torch's default; 1 suits toy drafts on shared cores)
    attn_impl: str = "auto"  # draft attention: "auto" (flex on CUDA, sdpa on CPU), "simple_flex_attention", "sdpa", "eager"
    warmup_ratio: float = 0.01  # share of all optimizer steps spent warming the LR up linearly (then cosine decay);
    # warm-up step i (from 0) runs at (i + 1) / warmup_steps of the peak, so the first update is never at rate 0
    train_lm_head: bool = False  # also train the draft's lm_head (speculators freezes it: a fresh draft keeps the
    # verifier's rows, a warm start its checkpoint's rows, a --rebuild map the verifier's rows for new tokens)
    draft_num_heads: int = 0  # new draft only: attention heads (0 = the verifier's count; K2.5: 64)
    draft_num_kv_heads: int = 0  # new EAGLE-3 draft only: key/value heads (0 = a dense verifier's; beside an MLA
    # verifier, as many as the heads). A draft of a dense verifier's own heads, KV heads and head dim is served by
    # vLLM 0.26-0.28 on its default path (FlashAttention-3, CUDA graphs), no workaround (docs/stages/05_evaluate.md)
    draft_head_dim: int = 0  # new draft only: head dim (0 = a dense verifier's; beside an MLA verifier 128, the
    # published K2/K2.5 MHA drafts' (AQ-MedAI, lightseekorg); a warm start uses its checkpoint's)
    draft_intermediate_size: int = 0  # new draft only: MLP width (0 = the verifier's dense intermediate_size; K2.5: 18432)
    anchor_to_init: float = 0.0  # L2-SP weight: adds anchor_to_init / 2 x the squared distance of the trained
    # weights from those training started with (a warm start's) to the loss; 0 = off (k-l-lambda's K2.6 fine-tunes:
    # 1e-4). Keeps a fine-tune near the published draft; one more fp32 copy of the trained weights in memory
    overwrite: bool = False  # start over: delete existing checkpoints/ instead of refusing (see also resume)
    grad_accum: int = 1  # packed rows summed per rank before each optimizer step: one step = world size x grad_accum
    # rows, so one GPU with grad_accum 8 reproduces an 8-GPU run's global batch (docs/stages/04_train.md)
    nproc_per_node: int = 0  # processes run_all.sh starts for 04 (torchrun when > 1); 0 = every visible GPU (CPU: 1).
    # 04_train.py itself trains on as many processes as torchrun gives it
    keep_checkpoints: int = 3  # step_N checkpoints kept (the newest ones; final/ is never pruned); 0 = keep all.
    # One K2.5 checkpoint is ~12.5 GB (fp32 weights and AdamW moments)
    min_free_gb: float = 1.0  # free space (GB) a checkpoint must leave on its disk; the save is refused before writing
    dflash_block_size: int = 8  # dflash: tokens per block = the verified token + block - 1 drafted (vLLM's k)
    dflash_num_layers: int = 6  # dflash: draft decoder layers (Qwen3 layers, all full attention, non-causal)
    dflash_num_kv_heads: int = 8  # dflash: key/value heads of the draft layers (0 = as many as the heads)
    dflash_max_anchors: int = 0  # dflash: blocks trained per packed row (0 = total_seq_len / 16: speculators' 512
    # per 8192 tokens); each supervises block - 1 tokens
    dflash_loss: str = "ce"  # dflash: speculators' loss name or JSON {name: weight} (its dflash default: ce)
    dflash_position_weight: str = "dpace"  # dflash: per-slot loss weight, "dpace" (needs ce) or "fixed-exp-decay"
    dflash_gamma: float = 4.0  # dflash: fixed-exp-decay's decay constant (slot i weighs exp(-(i - 1) / gamma))
    data_source: str = "offline"  # "offline" (hidden_states/ from stage 02) or "online" (states extracted as training
    # goes, by stage 02's vLLM servers: extract.server_args or --extract-url, into a spool of train.spool_gb)
    spool_gb: float = 8.0  # online: disk (GB, all ranks together) the states of the upcoming rows may take
    cache_gb: float = 0.0  # online: disk (GB, all ranks together) that keeps epoch 1's states for later epochs
    # ("hybrid": those samples are not extracted again; disk stays within spool_gb + cache_gb); 0 = re-extract all
    report_to: list[str] = field(default_factory=list)  # trackers besides metrics.jsonl: tensorboard, wandb (their own libraries; checkpoints/reports/)
    report_project: str = "eagle3pipe"  # wandb project of the run (WANDB_MODE=offline keeps it on disk)
    eval_every_steps: int = 0  # optimizer steps between held-out evaluations (0 = once an epoch, after its last step)
    export: str = "last"  # which weights checkpoints/final/ gets: "last" (the end of training) or "best" (the checkpoint of the evaluation with the highest simulated acceptance length)
    export_from: str = ""  # export this checkpoint (step_N or its folder) and exit; trains nothing, beside a running training
    export_to: str = ""  # folder --export-from writes; empty = checkpoints/export_step_N
    loss: str = "kl_div"  # speculators' loss by name (kl_div, rkl, jsd, ce, tv, nla, lk_hybrid) or a JSON dict of weights; kl_div = its EAGLE-3 default
    weight_decay: float = 0.01  # AdamW weight decay (speculators 0.9's default; TorchSpec's K2.5 recipe and SpecForge use 0)
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas (torch's default, which speculators 0.9, TorchSpec and SpecForge all keep)
    max_grad_norm: float = 1.0  # gradient-norm clipping, 0 = none (speculators 0.9 and TorchSpec's K2.5 configs: 1.0; SpecForge: 0.5)
    hidden_noise_std: float = 0.0  # uniform noise in [-std, std] added to the training rows' aux hidden states (speculators 0.9.0: none; before 0.9 its loader added 0.05)


@dataclass
class EvaluateConfig:
    draft: str = ""  # exported draft folder; empty = <data_dir>/checkpoints/final
    num_speculative_tokens: int = 3  # draft tokens proposed per verify step (k = vLLM's num_speculative_tokens;
    # SGLang's "steps 3, topk 1, num_draft_tokens 4" is k = 3: its draft-token count includes the verified token).
    # EAGLE-3 drafts only: a DFlash draft drafts its block size - 1
    num_prompts: int = 64  # prompts sent from every set, chosen by shared.seed (0 = all; a smaller set is an error)
    concurrency: list[int] = field(default_factory=lambda: [8])  # requests in flight; each level is one pass over
    # every set on every server (tokens/s and speedup per level; acceptance pools the levels)
    max_completion_tokens: int = 512  # cap per evaluation request
    prompts: str = ""  # one held-out JSONL chat file (messages/conversations), cut at the last user turn; its report
    # row is named after the file
    benchmarks: list[str] = field(default_factory=list)  # named sets: mtbench, gsm8k, humaneval, math500 (from the
    # hub), NAME=FILE (a known set's schema in a local .jsonl/.parquet), or a JSONL chat file (eval_sets.py)
    baseline_draft: list[str] = field(default_factory=list)  # other draft folders measured beside the exported one,
    # each on its own server with the same verifier, each at its own k (DIR, or NAME=DIR to name its report column)
    temperature: float = 0.0  # sampling temperature of evaluation requests (0 = greedy)
    request_timeout_s: float = 600.0  # per-request client timeout, seconds
    eval_url: str = ""  # a running vLLM server already serving verifier + draft (no /v1); empty = start one
    baseline: bool = True  # also measure the verifier alone, for tokens/s without a draft and the speedup (starts
    # one more server unless --baseline-url)
    baseline_url: str = ""  # a running vLLM server serving the verifier without a draft (no /v1)
    server_args: VllmArgs = field(default_factory=list)  # vLLM flags for servers started here; non-empty REPLACES
    # the platform defaults (CPU: --enforce-eager; GPU: none). Always added: --model, --host, --port,
    # --served-model-name, --speculative-config, --tensor-parallel-size, --trust-remote-code (shared.trust_remote_code)
    vllm_platform: str = "auto"  # "auto" (ask the vLLM interpreter which platform it was built for), "cpu" or "gpu";
    # CPU adds --enforce-eager and VLLM_CPU_KVCACHE_SPACE=1 (GiB, unless set in the environment); GPU adds neither
    tensor_parallel_size: int = 0  # --tensor-parallel-size of servers started here; 0 = every GPU vLLM sees (CPU: 1)
    server_start_timeout_s: float = 3600.0  # seconds to wait for a started server to answer (K2.5 loads for minutes)
    draft_attention_backend: str = "auto"  # vLLM attention backend of an EAGLE-3 draft alone ("attention_backend" in
    # --speculative-config): "auto" = FLEX_ATTENTION on a GPU with vLLM 0.26-0.28 when the draft's heads, KV heads or
    # head size differ from the verifier's (every K2.5 draft: MLA), where FlashAttention-3 dies at start-up
    # (vllm#53336, fixed in 0.29), else vLLM's choice; "none" = always vLLM's choice; or a backend name (FLASH_ATTN,
    # ...; on vLLM < 0.29 with the V1 model runner, the one that reads it). DFlash drafts: vLLM's choice always


@dataclass
class PlanConfig:
    # What `run_all.sh --plan` (eagle3pipe/costs.py) assumes to cost a run before 01b; no stage reads it. Defaults:
    # Kimi-K2.5 on 8 x H200 nodes, measured where BENCHMARKS.md measured it, else projected (say which); set them
    # from your own first hour (`run_all.sh --status` shows each stage's rate).
    prompt_tokens: int = 1024  # mean tokens of a question's prompt, chat template included (assumed, not measured)
    completion_tokens: int = 4096  # mean tokens 01b generates per question, reasoning + answer (assumed: K2.5 thinks
    # for thousands of tokens; BENCHMARKS.md's K2.5 projections use 4 k-token samples). The disk bound uses max_seq_len
    generate_tokens_per_s: float = 2000.0  # 01b: generated tokens/s of one server (projected: vLLM's Kimi-K2-Thinking
    # recipe, same architecture and int4, 8 x H200 TP 8, peak output 2100 tok/s; its overloaded mean was 486)
    extract_tokens_per_s: float = 16000.0  # 02 and 04 online: tokens/s of one extraction server (projected, 8 x H200
    # TP 8: BENCHMARKS.md "Stage 02 on vLLM", 16-36 k tok/s, the low end)
    train_tokens_per_s: float = 27700.0  # 04: tokens/s of one training process (measured: one H200, K2.5 EAGLE-3
    # draft, 32768-token rows, BENCHMARKS.md "Data parallel"; not measured for DFlash)
    train_scaling: float = 0.91  # 04: each process's share of that rate when several train (projected: 0.91-0.96 for
    # 8 GPUs of one node, BENCHMARKS.md "Data parallel", the low end)
    packing_fill: float = 0.927  # 04: share of a packed row's slots holding tokens (measured at 32768-token rows)
    checkpoint_gb: float = 0.0  # 04: one step_N checkpoint; 0 = computed on the model 04 builds (fp32 weights +
    # AdamW moments: 12.46 GB for the K2.5 EAGLE-3 draft, as measured; 42.67 GB DFlash; needs the verifier config.json)
    evaluate_tokens_per_s: float = 80.0  # 05: generated tokens/s of one request (projected: Dynamo's K2.5 benchmark
    # shows ~105 tok/s per user on GB200 without a draft; an H200 is slower); a level of concurrency c runs c at once
    server_start_s: float = 1800.0  # each vLLM server a stage starts: loading K2.5's 547 GB (~0.5 h, BENCHMARKS.md)


DRAFTS = ("eagle3", "eagle3_mla", "dflash")  # train.draft: the draft families (train_drafts.FAMILIES)


SECTIONS: dict[str, type] = {
    "shared": SharedConfig,
    "prepare": PrepareConfig,
    "generate": GenerateConfig,
    "extract": ExtractConfig,
    "vocab": VocabConfig,
    "train": TrainConfig,
    "evaluate": EvaluateConfig,
    "plan": PlanConfig,
}


@dataclass
class PipelineConfig:
    shared: SharedConfig = field(default_factory=SharedConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    vocab: VocabConfig = field(default_factory=VocabConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    source: str = "<defaults>"  # where the YAML came from, for error messages and provenance

    @property
    def data_dir(self) -> Path:
        return Path(self.shared.data_dir)

    @property
    def tokenizer_path(self) -> str:
        return self.shared.tokenizer or self.shared.verifier

    @property
    def draft_layer_ids(self) -> list[int]:
        """The verifier states the draft reads: train.draft_layer_ids, or all of shared.aux_layer_ids (what 02
        stores)."""
        return list(self.train.draft_layer_ids or self.shared.aux_layer_ids)

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def section_hash(self, *sections: str) -> str:
        """Stable hash of the named sections, used to decide whether a finished stage can be skipped."""
        payload = {name: dataclasses.asdict(getattr(self, name)) for name in sections}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def validate(self, stage: str) -> None:
        """Cheap checks that must pass before any server or GPU work starts."""
        s = self.shared
        if not s.aux_layer_ids or sorted(set(s.aux_layer_ids)) != s.aux_layer_ids or min(s.aux_layer_ids) < 0:
            raise ConfigError(f"shared.aux_layer_ids must be ascending distinct layer ids, got {s.aux_layer_ids}")
        if s.aux_layer_ids[0] == 0:
            # vLLM's DeepSeek-V3 model (K2.5's) adds the residual to the state entering layer k, and there is none
            # before layer 0: its engine dies at the first request, in stage 02 and when serving the draft alike
            raise ConfigError(f"shared.aux_layer_ids {s.aux_layer_ids}: layer id 0 (the embeddings) cannot be "
                              "captured by vLLM's DeepSeek-V3 model; use ids >= 1 (Kimi-K2.5: 2, 30, 58)")
        if s.draft_vocab_size > s.vocab_size:
            raise ConfigError(f"shared.draft_vocab_size {s.draft_vocab_size} exceeds shared.vocab_size {s.vocab_size}")
        if stage == "prepare":
            if not self.prepare.dataset:
                raise ConfigError("prepare.dataset is empty: pass --dataset PATH_OR_HF_ID (repeatable)")
            if self.prepare.truncation not in ("drop", "truncate"):
                raise ConfigError(f"prepare.truncation must be 'drop' or 'truncate', got {self.prepare.truncation!r}")
        if stage in ("prepare", "generate", "extract", "train"):
            self._validate_lengths()
        if stage in ("prepare", "generate", "extract") and not self.tokenizer_path:
            raise ConfigError("shared.verifier (or shared.tokenizer) is empty: pass --verifier DIR")
        if stage == "generate":
            self._validate_generate()
        if stage == "extract":
            if self.extract.input not in ("synthetic", "prepared"):
                raise ConfigError(f"extract.input must be 'synthetic' or 'prepared', got {self.extract.input!r}")
            if self.extract.storage_dtype not in ("bf16", "fp8"):
                raise ConfigError(f"extract.storage_dtype must be 'bf16' or 'fp8', got {self.extract.storage_dtype!r}")
            if self.extract.device_map not in ("", "auto"):
                raise ConfigError(f"extract.device_map must be '' or 'auto', got {self.extract.device_map!r}")
            if self.extract.num_workers < 0 or self.extract.writer_threads < 1 or self.extract.batch_tokens < 1:
                raise ConfigError("extract.num_workers must be >= 0, extract.writer_threads and batch_tokens >= 1")
            self._validate_extract_backend()
        if stage in ("vocab", "train") and self.train.draft not in DRAFTS:
            raise ConfigError(f"train.draft must be one of {', '.join(DRAFTS)}, got {self.train.draft!r}")
        if stage == "train":
            t = self.train
            self._validate_draft()
            if t.export_format not in ("eagle3", "speculators"):
                raise ConfigError(f"train.export_format must be 'eagle3' or 'speculators', got {t.export_format!r}")
            if t.draft == "eagle3_mla" and t.export_format != "eagle3":
                raise ConfigError("train.export_format speculators: speculators' format has no MLA layer vLLM reads; "
                                  "an eagle3_mla draft exports the Eagle3DeepseekV2ForCausalLM layout (eagle3)")
            if not 0.0 <= t.anchor_to_init < float("inf"):
                raise ConfigError(f"train.anchor_to_init must be a finite weight >= 0 (0 = off), got "
                                  f"{t.anchor_to_init}")
            if t.attn_impl not in ("auto", "simple_flex_attention", "sdpa", "eager"):
                raise ConfigError(f"train.attn_impl must be auto, simple_flex_attention, sdpa or eager, got {t.attn_impl!r}")
            if t.ttt_steps < 1 or t.total_seq_len < 2 or t.checkpoint_every < 1 or t.log_every < 1 or t.epochs < 1:
                raise ConfigError("train.ttt_steps, epochs, checkpoint_every, log_every must be >= 1 and total_seq_len >= 2")
            if t.cpu_threads < 0:
                raise ConfigError(f"train.cpu_threads must be >= 0 (0 = torch's default), got {t.cpu_threads}")
            if not 0.0 <= t.eval_fraction < 1.0:
                raise ConfigError(f"train.eval_fraction must be in [0, 1), got {t.eval_fraction}")
            if t.max_samples < 0:
                raise ConfigError(f"train.max_samples must be >= 0 (0 = the whole training split), got "
                                  f"{t.max_samples}")
            if t.resume and t.overwrite:
                raise ConfigError("train.resume and train.overwrite exclude each other: pick one")
            if t.grad_accum < 1 or t.nproc_per_node < 0 or t.keep_checkpoints < 0 or t.min_free_gb < 0:
                raise ConfigError("train.grad_accum must be >= 1; train.nproc_per_node, keep_checkpoints and "
                                  "min_free_gb >= 0")
            self._validate_train_monitoring()
            if t.data_source not in ("offline", "online"):
                raise ConfigError(f"train.data_source must be 'offline' or 'online', got {t.data_source!r}")
            if t.cache_gb and t.data_source != "online":
                raise ConfigError(f"train.cache_gb {t.cache_gb:g}: a cache of extracted states applies to "
                                  "train.data_source online only (offline reads hidden_states/)")
            if t.data_source == "online":
                if not 0 < t.spool_gb < float("inf"):
                    raise ConfigError(f"train.spool_gb must be a finite number of GB > 0 online, got {t.spool_gb}")
                if not 0 <= t.cache_gb < float("inf"):
                    raise ConfigError(f"train.cache_gb must be a finite number of GB >= 0 (0 = no cache), got "
                                      f"{t.cache_gb}")
                if self.extract.input not in ("synthetic", "prepared"):
                    raise ConfigError(f"extract.input must be 'synthetic' or 'prepared', got {self.extract.input!r}")
                self._validate_extract_backend(online=True)
        if stage == "evaluate":
            ev = self.evaluate
            if not ev.prompts and not ev.benchmarks:
                raise ConfigError("evaluate.prompts and evaluate.benchmarks are empty: pass --prompts FILE.jsonl "
                                  "(held-out chat prompts) or --benchmarks mtbench gsm8k humaneval math500")
            if ev.num_speculative_tokens < 1 or not ev.concurrency or min(ev.concurrency) < 1:
                raise ConfigError("evaluate.num_speculative_tokens and every evaluate.concurrency level must be >= 1, "
                                  f"got {ev.num_speculative_tokens} and {ev.concurrency}")
            if len(set(ev.concurrency)) != len(ev.concurrency) or ev.num_prompts < 0:
                raise ConfigError(f"evaluate.concurrency lists a level twice ({ev.concurrency}) or "
                                  f"evaluate.num_prompts < 0 ({ev.num_prompts})")
            if ev.baseline_draft and not s.verifier:
                raise ConfigError("evaluate.baseline_draft needs shared.verifier: each draft gets a server started here")
            if not ev.eval_url and not s.verifier:
                raise ConfigError("shared.verifier is empty: pass --verifier DIR (or --eval-url of a running server)")
            if ev.draft_attention_backend not in ("auto", "none") and not re.fullmatch(r"[A-Z][A-Z0-9_]*",
                                                                                   ev.draft_attention_backend):
                raise ConfigError("evaluate.draft_attention_backend must be auto, none or a vLLM backend name such as "
                                  f"FLEX_ATTENTION, got {ev.draft_attention_backend!r}")
            if ev.vllm_platform not in ("auto", "cpu", "gpu"):
                raise ConfigError(f"evaluate.vllm_platform must be auto, cpu or gpu, got {ev.vllm_platform!r}")
            if ev.tensor_parallel_size < 0 or ev.server_start_timeout_s <= 0:
                raise ConfigError("evaluate.tensor_parallel_size must be >= 0 and evaluate.server_start_timeout_s > 0")


    def _validate_draft(self) -> None:
        """train.draft's layer ids (a subset of what 02 stores) and the DFlash settings."""
        s, t = self.shared, self.train
        ids = self.draft_layer_ids
        if sorted(set(ids)) != ids or not set(ids) <= set(s.aux_layer_ids):
            raise ConfigError(f"train.draft_layer_ids {t.draft_layer_ids} must be ascending ids among "
                              f"shared.aux_layer_ids {s.aux_layer_ids} (the states stage 02 stores)")
        if t.draft in ("eagle3", "eagle3_mla") and len(ids) != 3:
            raise ConfigError(f"an EAGLE-3 draft reads 3 verifier states, got {ids}: name 3 of shared.aux_layer_ids "
                              f"{s.aux_layer_ids} with train.draft_layer_ids (--draft-layer-ids)")
        if t.draft != "dflash":
            return
        if t.train_lm_head and s.draft_vocab_size == s.vocab_size:
            raise ConfigError("train.train_lm_head with a full-vocabulary DFlash draft: speculators' export leaves its "
                              "lm_head out (vLLM takes the verifier's), so training it would be lost")
        if t.dflash_block_size < 2 or t.dflash_num_layers < 1 or t.dflash_num_kv_heads < 0 or t.dflash_max_anchors < 0:
            raise ConfigError("train.dflash_block_size must be >= 2, dflash_num_layers >= 1, dflash_num_kv_heads and "
                              "dflash_max_anchors >= 0")
        if t.dflash_position_weight not in ("dpace", "fixed-exp-decay"):
            raise ConfigError(f"train.dflash_position_weight must be 'dpace' or 'fixed-exp-decay', got "
                              f"{t.dflash_position_weight!r}")
        if t.dflash_position_weight == "dpace" and t.dflash_loss != "ce":
            raise ConfigError(f"train.dflash_position_weight dpace weighs slots by their cross-entropy: it needs "
                              f"train.dflash_loss ce, got {t.dflash_loss!r} (or use fixed-exp-decay)")
        if t.dflash_gamma <= 0:
            raise ConfigError(f"train.dflash_gamma must be > 0, got {t.dflash_gamma}")

    def _validate_train_monitoring(self) -> None:
        """The trackers, evaluations, export choice and recipe of stage 04 (cheap checks; the loss name is
        checked against speculators' own table at start)."""
        t = self.train
        for name in t.report_to:
            if name not in REPORT_TO:
                raise ConfigError(f"train.report_to: unknown tracker {name!r} (known: {', '.join(REPORT_TO)})")
        if t.eval_every_steps < 0:
            raise ConfigError(f"train.eval_every_steps must be >= 0 (0 = once an epoch), got {t.eval_every_steps}")
        if t.export not in ("last", "best"):
            raise ConfigError(f"train.export must be 'last' or 'best', got {t.export!r}")
        if t.export == "best" and t.eval_fraction <= 0 and not t.export_from:
            raise ConfigError("train.export best chooses by the held-out evaluation, and train.eval_fraction is 0: "
                              "hold rows out (--eval-fraction 0.05) or export last")
        if t.export_to and not t.export_from:
            raise ConfigError("train.export_to names the folder of --export-from: pass --export-from step_N too")
        if t.export_from and (t.resume or t.overwrite):
            raise ConfigError("train.export_from exports a checkpoint and trains nothing: drop --resume/--overwrite")
        if t.weight_decay < 0 or t.max_grad_norm < 0 or t.hidden_noise_std < 0:
            raise ConfigError("train.weight_decay, max_grad_norm and hidden_noise_std must be >= 0, got "
                              f"{t.weight_decay}, {t.max_grad_norm}, {t.hidden_noise_std}")
        if len(t.adam_betas) != 2 or not all(0.0 <= b < 1.0 for b in t.adam_betas):
            raise ConfigError(f"train.adam_betas must be two numbers in [0, 1), got {t.adam_betas}")

    def _validate_extract_backend(self, online: bool = False) -> None:
        """``online``: 04's online source, which always extracts on vLLM (extract.backend does not apply)."""
        ex = self.extract
        if ex.backend not in ("transformers", "vllm"):
            raise ConfigError(f"extract.backend must be 'transformers' or 'vllm', got {ex.backend!r}")
        if not online and ex.backend == "transformers" and (ex.extract_url or ex.server_args):
            raise ConfigError("extract.extract_url / extract.server_args are for extract.backend: vllm "
                              "(pass --backend vllm)")
        for url in ex.extract_url:
            if not url.startswith(("http://", "https://")) or url.rstrip("/").endswith("/v1"):
                raise ConfigError(f"extract.extract_url {url!r}: give the server root without /v1, e.g. http://HOST:8000")
        if ex.concurrency < 1 or ex.max_retries < 0 or ex.verify_tokens < 0:
            raise ConfigError("extract.concurrency must be >= 1, extract.max_retries and verify_tokens >= 0")
        if ex.request_timeout_s <= 0 or ex.retry_backoff_s <= 0 or ex.server_start_timeout_s <= 0:
            raise ConfigError("extract.request_timeout_s, retry_backoff_s and server_start_timeout_s must be > 0")
        for key in ("verify_min_agreement", "max_error_share"):
            if not 0.0 <= getattr(ex, key) <= 1.0:
                raise ConfigError(f"extract.{key} must be in [0, 1], got {getattr(ex, key)}")

    def _validate_lengths(self) -> None:
        """Every row a stage keeps must fit one packed training row: speculators 0.9 cuts a longer sample to
        ``total_seq_len`` tokens (its sampler clips the length, its collate copies only the first tokens), so the
        rest would be generated, extracted (57 KB/token for K2.5) and stored, but never trained."""
        s, t = self.shared, self.train
        if s.max_seq_len > t.total_seq_len:
            raise ConfigError(
                f"shared.max_seq_len {s.max_seq_len} exceeds train.total_seq_len {t.total_seq_len}: rows up to "
                f"{s.max_seq_len} tokens would be kept and extracted, and training would cut each to its first "
                f"{t.total_seq_len} tokens. Lower shared.max_seq_len (--max-seq-len) or raise train.total_seq_len "
                "(--total-seq-len) to at least it")

    def _validate_generate(self) -> None:
        g = self.generate
        if not self.shared.vllm_url and not g.server_args:
            raise ConfigError("shared.vllm_url is empty: pass --vllm-url http://HOST:PORT (repeatable), or set "
                              "generate.server_args (e.g. --server-args '--tensor-parallel-size 8 --reasoning-parser "
                              "kimi_k2') to start the verifier's server here")
        if not self.shared.vllm_url and not self.shared.verifier:
            raise ConfigError("generate.server_args starts a server for shared.verifier, which is empty: pass "
                              "--verifier DIR")
        if g.server_start_timeout_s <= 0:
            raise ConfigError(f"generate.server_start_timeout_s must be > 0, got {g.server_start_timeout_s}")
        for url in self.shared.vllm_url:
            if not url.startswith(("http://", "https://")) or url.rstrip("/").endswith("/v1"):
                raise ConfigError(f"shared.vllm_url {url!r}: give the server root without /v1, e.g. http://HOST:8000")
        for key in ("concurrency", "max_completion_tokens"):
            if getattr(g, key) < 1:
                raise ConfigError(f"generate.{key} must be >= 1, got {getattr(g, key)}")
        for key in ("request_timeout_s", "retry_backoff_s"):
            if getattr(g, key) <= 0:
                raise ConfigError(f"generate.{key} must be > 0 seconds, got {getattr(g, key)}")
        if g.max_retries < 0 or g.max_samples < 0 or g.min_completion_tokens < 0:
            raise ConfigError("generate.max_retries, max_samples and min_completion_tokens must be >= 0")
        if g.min_completion_tokens > g.max_completion_tokens:
            raise ConfigError(f"generate.min_completion_tokens {g.min_completion_tokens} exceeds max_completion_tokens "
                              f"{g.max_completion_tokens}: no completion could enter data.jsonl")
        for key in ("empty_reasoning_max_share", "max_error_share"):
            if not 0.0 <= getattr(g, key) <= 1.0:
                raise ConfigError(f"generate.{key} must be in [0, 1], got {getattr(g, key)}")
        for kind in g.permanent_error_kinds:
            if kind not in REQUEST_ERROR_KINDS and not re.fullmatch(r"http_[1-4][0-9][0-9]", kind):
                raise ConfigError(f"generate.permanent_error_kinds: unknown error kind {kind!r} (known: "
                                  f"{', '.join(REQUEST_ERROR_KINDS)}, http_NNN for a 4xx status)")
        if g.request_extra_json:
            try:
                extra = json.loads(g.request_extra_json)
            except json.JSONDecodeError as e:
                raise ConfigError(f"generate.request_extra_json is not valid JSON ({e.msg})") from None
            if not isinstance(extra, dict):
                raise ConfigError("generate.request_extra_json must be a JSON object, e.g. '{\"top_k\": 20}'")
            kwargs = extra.get("chat_template_kwargs", {})
            if not isinstance(kwargs, dict):
                raise ConfigError("generate.request_extra_json: chat_template_kwargs must be a JSON object")
            if "thinking" in kwargs and kwargs["thinking"] != self.shared.thinking:
                raise ConfigError(f"generate.request_extra_json sets chat_template_kwargs.thinking = "
                                  f"{kwargs['thinking']} but shared.thinking is {self.shared.thinking}: set "
                                  "--thinking/--no-thinking instead (every stage renders with it)")


# ---------------------------------------------------------------------------------------------------------------
# Type checking of YAML values and CLI parsing, generated from the dataclass fields.


def field_types(cls: type) -> dict[str, typing.Any]:
    return typing.get_type_hints(cls)


def _all_field_types() -> list[tuple[str, typing.Any]]:
    return [(name, typ) for cls in SECTIONS.values() for name, typ in field_types(cls).items()]


def _check_value(key: str, value, typ, source: str):
    """Return ``value`` coerced to ``typ`` or raise a ConfigError naming the key."""
    if typ is VllmArgs:
        return _check_vllm_args(key, value, source)
    origin = typing.get_origin(typ)
    if origin is list:
        (item_type,) = typing.get_args(typ)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]  # a single value where a list is expected: accept it as a one-item list
        if not isinstance(value, list):
            raise ConfigError(f"{source}: key '{key}' must be a list of {item_type.__name__}, got {value!r}")
        return [_check_value(f"{key}[{i}]", v, item_type, source) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        raise AssertionError("optional fields are not used in configs")  # internal invariant
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: key '{key}' must be true or false, got {value!r}")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: key '{key}' must be an integer, got {value!r}")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{source}: key '{key}' must be a number, got {value!r}")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{source}: key '{key}' must be a string, got {value!r}")
        return value
    raise AssertionError(f"unsupported config field type {typ}")  # internal invariant


def load_config(path: str | Path | None = None, overrides: dict[str, dict] | None = None) -> PipelineConfig:
    """Load YAML (if given) over the defaults, then apply ``overrides`` ({section: {key: value}})."""
    cfg = PipelineConfig()
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of sections ({', '.join(SECTIONS)}), got {type(raw).__name__}")
        cfg.source = str(path)
    for layer, source in ((raw, cfg.source), (overrides or {}, "command line")):
        for section, values in layer.items():
            if section not in SECTIONS:
                raise ConfigError(f"{source}: unknown section '{section}' (known: {', '.join(SECTIONS)})")
            if values is None:
                continue
            if not isinstance(values, dict):
                raise ConfigError(f"{source}: section '{section}' must be a mapping, got {values!r}")
            obj = getattr(cfg, section)
            types_ = field_types(type(obj))
            for key, value in values.items():
                if key not in types_:
                    raise ConfigError(
                        f"{source}: unknown key '{section}.{key}' (known in {section}: {', '.join(types_)})"
                    )
                setattr(obj, key, _check_value(f"{section}.{key}", value, types_[key], source))
    return cfg


# flags of another section's field a stage also takes (one setting, one flag name in every stage that reads it)
BORROWED_FLAGS: dict[str, list[tuple[str, str]]] = {"train": [  # 04 online: its servers, retries and error share
    ("extract", "extract_url"), ("extract", "server_args"), ("extract", "max_retries"), ("extract", "retry_backoff_s"),
    ("extract", "max_error_share")],
    "vocab": [("train", "draft")]}  # 03 resolves the DFlash mask token for --draft dflash


def cli_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def field_docs(cls: type) -> dict[str, str]:
    """Each field of config dataclass ``cls`` with its description: the comment on the field's line in this file
    and the comment lines right below it, joined (the one source of --help and of any reference generated from the
    config)."""
    import ast
    import inspect
    import io
    import textwrap
    import tokenize

    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    body = [node for node in ast.parse(source).body[0].body if isinstance(node, ast.AnnAssign)]
    docs = {}
    for node in body:
        parts = [comments[node.end_lineno]] if node.end_lineno in comments else []
        row = node.end_lineno + 1  # comment-only lines continuing it
        while row <= len(lines) and lines[row - 1].strip().startswith("#"):
            parts.append(comments[row])
            row += 1
        docs[node.target.id] = " ".join(parts)
    return docs


def shown_default(f: dataclasses.Field) -> str:
    """A field's default as it is written on the command line (lists space-separated, booleans as in YAML)."""
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return " ".join(map(str, value)) or "none"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value) if value != "" else "empty"


def _join_flag_values(argv: list[str], flags: set[str]) -> list[str]:
    """``--server-args --enforce-eager`` as ``--server-args=--enforce-eager``: argparse would read a value that
    starts with a dash as a flag of ours."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in flags and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _split_words(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as e:  # an unclosed quote
        raise argparse.ArgumentTypeError(f"{e} in {text!r}") from None


def build_parser(stage: str, description: str | None) -> argparse.ArgumentParser:
    """A parser with --config plus one flag per field of the shared section and of ``stage``'s section, each
    described by its field's comment (``field_docs``) and default."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config file (sections: " + ", ".join(SECTIONS) + "); flags given "
                                         "here override its values, which override the defaults shown")
    sections = ["shared"] + ([stage] if stage in SECTIONS and stage != "shared" else [])
    for section in sections + list(dict.fromkeys(s for s, _ in BORROWED_FLAGS.get(stage, []))):
        group = parser.add_argument_group(section)
        cls = SECTIONS[section]
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if section not in sections and (section, f.name) not in BORROWED_FLAGS[stage]:
                continue
            typ = field_types(cls)[f.name]
            dest = f"{section}.{f.name}"
            # argparse formats help with %: a literal one is doubled
            help_text = f"{docs[f.name]} (default: {shown_default(f)})".replace("%", "%%")
            metavar = f.name.upper()
            if typ is bool:
                group.add_argument(cli_flag(f.name), dest=dest, action=argparse.BooleanOptionalAction, default=None,
                                   help=help_text)
            elif typ is VllmArgs:
                # one string split as a shell would; repeated flags add up
                group.add_argument(cli_flag(f.name), dest=dest, type=_split_words, action="extend", default=None,
                                   metavar="'FLAGS'", help=help_text)
            elif typing.get_origin(typ) is list:
                (item_type,) = typing.get_args(typ)
                # repeatable and multi-valued: --vllm-url A --vllm-url B or --aux-layer-ids 2 30 58
                group.add_argument(cli_flag(f.name), dest=dest, type=item_type, nargs="+", action="extend",
                                   default=None, metavar=metavar, help=help_text)
            else:
                group.add_argument(cli_flag(f.name), dest=dest, type=typ, default=None, metavar=metavar, help=help_text)
    return parser


def parse_stage_args(stage: str, argv: list[str] | None = None, description: str | None = None) -> PipelineConfig:
    """Parse ``argv`` for ``stage``: YAML from --config, then flags on top. Validates before returning."""
    argv = _join_flag_values(list(sys.argv[1:] if argv is None else argv),
                             {cli_flag(name) for name, typ in _all_field_types() if typ is VllmArgs})
    args = build_parser(stage, description).parse_args(argv)
    overrides: dict[str, dict] = {}
    for dest, value in vars(args).items():
        if dest == "config" or value is None:
            continue
        section, key = dest.split(".", 1)
        overrides.setdefault(section, {})[key] = value
    cfg = load_config(args.config, overrides)
    cfg.validate(stage)
    return cfg
