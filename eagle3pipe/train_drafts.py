"""What stage 04 does differently per draft family (``train.draft``): EAGLE-3 (draft.py), EAGLE-3 with MLA attention
(draft_mla.py) or DFlash (draft_dflash.py).

One object per family holds the forward's keyword arguments, the metric sums it reads and how a metrics line, the
progress line and the curves present them, the RNG each packed row's forward runs under, the settings a --resume
must find unchanged, and the export. train.py's loop is the same for both; the data differ only in the collate's
preprocess (train_data.DraftStates: EAGLE-3 shifts by one token, DFlash does not).

DFlash's anchors (the positions its training blocks start at) are drawn by speculators with the global RNG, on the
device, in every forward. Each packed row's forward runs under an RNG seeded from (shared.seed, epoch, the row's
place in the epoch's packing), forked so nothing else's stream moves: the same row gets the same anchors whichever
rank, world size, grad_accum, resume or data source (offline / online) trains it.
"""

from __future__ import annotations

import hashlib
import logging
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from .cli import StageError
from .config import PipelineConfig
from .records import DataDir
from .records_vocab import load_vocab_mapping, load_vocab_summary
from .train_metrics import (
    dflash_metric_keys,
    metric_keys,
    plot_curves,
    plot_dflash_curves,
    summarize,
    summarize_dflash,
)

log = logging.getLogger(__name__)

def anchor_seed(*parts) -> int:
    """A 63-bit seed of one row's DFlash anchors from ``parts`` (shared.seed, epoch or "eval", row position):
    distinct rows, distinct streams, none shared with train.row_seed's noise."""
    text = ":".join(map(str, ("dflash anchors", *parts)))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


@contextmanager
def seeded_rng(seed: int, device: torch.device):
    """torch's global RNG (CPU and ``device``) seeded with ``seed`` inside, restored after."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


# ---------------------------------------------------------------------------------------------------------------
# Warm starts (EAGLE-3, MHA or MLA): what both check of the checkpoint against vocab/ and the states 02 stored


def check_warm_start_vocab(cfg: PipelineConfig, summary) -> None:
    """vocab/ must have been built by 03 for this --finetune-from (its map kept, or rebuilt with the rows remapped)."""
    dd, t = DataDir(cfg.data_dir), cfg.train
    if summary.source == "data":
        raise StageError(f"{dd.vocab} was built from our data without the warm-start checkpoint: rerun "
                         f"03_build_vocab_mapping.py --finetune-from {t.finetune_from} (keeps its map, the default) "
                         "or add --rebuild (replaces it; its lm_head rows are then remapped)")
    if Path(summary.checkpoint).resolve() != Path(t.finetune_from).resolve():
        raise StageError(f"{dd.vocab} was built for checkpoint {summary.checkpoint}, --finetune-from is "
                         f"{t.finetune_from}: rerun 03_build_vocab_mapping.py")


def warm_start_aux_ids(cfg: PipelineConfig, declared: list[int]) -> list[int]:
    """The aux ids a warm-start checkpoint was trained on: those it declares, or (none) the engines' default."""
    from .draft import default_aux_layer_ids, verifier_text_config

    if declared:
        return list(declared)
    s = cfg.shared
    num_layers = verifier_text_config(s.verifier, s.trust_remote_code).num_hidden_layers
    ids = default_aux_layer_ids(num_layers)
    log.warning("%s names no aux layer ids: vLLM and SGLang then capture their default (2, L/2, L-3), for this "
                "%d-layer verifier %s; taking those as the layers it was trained on", cfg.train.finetune_from,
                num_layers, ids)
    return ids


def check_aux_ids(ckpt_ids: list[int], ours: list[int], folder: str) -> None:
    """A warm-start checkpoint must read the same verifier states as our data holds."""
    if list(ckpt_ids) == list(ours):
        return
    if [k + 1 for k in ckpt_ids] == list(ours):
        log.warning("%s names its aux layers %s: the 'output of layer k' convention for the states our data holds "
                    "(%s, vLLM's 'entering layer k'); the export writes %s", folder, ckpt_ids, ours, ours)
        return
    raise StageError(f"{folder}: trained on aux layers {ckpt_ids}, our hidden states hold {ours} "
                     "(--aux-layer-ids, stage 02): the draft would read different verifier states")



class Eagle3Family:
    """speculators' Eagle3DraftModel: TTT unroll, KL loss, acc@k; exported flat (vLLM and SGLang) or speculators'."""

    name = "eagle3"

    def __init__(self, cfg: PipelineConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self.keys = metric_keys(cfg.train.ttt_steps)
        self.loss_name = cfg.train.loss

    def call_kwargs(self, loss_config: dict) -> dict:
        """The forward's keyword arguments, with speculators' loss config of train.loss (train.resolve_loss)."""
        return {"ttt_steps": self.cfg.train.ttt_steps, "ttt_step_loss_decay": 1.0, "loss_config": loss_config}

    def summarize(self, totals: dict) -> dict:
        return summarize(totals, self.cfg.train.ttt_steps)

    def progress_fields(self, row: dict) -> dict:
        return {"loss": f"{row['loss']:.3f}",
                **{f"acc@{i}": f"{row[f'acc_{i}']:.3f}" for i in range(1, self.cfg.train.ttt_steps + 1)}}

    def row_rng(self, epoch, position: int):  # noqa: ARG002 (EAGLE-3's forward draws nothing at random)
        return nullcontext()

    def new_model(self, d2t: torch.Tensor, t2d: torch.Tensor, attn_impl: str):
        """A new draft at train.* dims on the vocab map (d2t, t2d): what 04 trains without --finetune-from, and
        what ``run_all.sh --plan`` sizes (built on the meta device: costs.draft_size)."""
        from . import draft

        s, t = self.cfg.shared, self.cfg.train
        layer_config = draft.fresh_layer_config(s.verifier, t.draft_num_heads, t.draft_num_kv_heads,
                                                t.draft_head_dim, t.draft_intermediate_size, s.trust_remote_code)
        model = draft.build_draft_model(layer_config, verifier=s.verifier, aux_layer_ids=self.cfg.draft_layer_ids,
                                        d2t=d2t, t2d=t2d, ttt_steps=t.ttt_steps, attn_impl=attn_impl)
        return model, layer_config

    def identity(self) -> dict:
        return {"train.draft": self.name, "train.draft_layer_ids": self.cfg.draft_layer_ids}

    def export(self, model, out_dir: Path, base_config: dict | None) -> Path:
        from . import draft

        if self.cfg.train.export_format == "speculators":
            return draft.export_speculators(model, out_dir)
        return draft.export_flat(model, out_dir, self.cfg.draft_layer_ids, base_config)

    def plot(self, metrics_path: Path, out_png: Path) -> None:
        plot_curves(metrics_path, out_png, self.cfg.train.ttt_steps, self.cfg.train.loss)


class Eagle3MLAFamily(Eagle3Family):
    """EAGLE-3 whose decoder layer is the verifier's MLA attention (draft_mla.py): speculators' TTT unroll, loss,
    metrics and vocabulary map as for eagle3; exported in the layout vLLM's Eagle3DeepseekV2ForCausalLM loads."""

    name = "eagle3_mla"

    def new_model(self, d2t: torch.Tensor, t2d: torch.Tensor, attn_impl: str):
        """A new MLA draft of the verifier's MLA geometry at train.* heads / MLP on the vocab map (d2t, t2d): what 04
        trains without --finetune-from, and what ``run_all.sh --plan`` sizes (on the meta device: costs.draft_size)."""
        from . import draft_mla

        s, t = self.cfg.shared, self.cfg.train
        layer = draft_mla.layer_config(s.verifier, num_heads=t.draft_num_heads,
                                       intermediate_size=t.draft_intermediate_size,
                                       trust_remote_code=s.trust_remote_code)
        model = draft_mla.build_model(layer, verifier=s.verifier, aux_layer_ids=self.cfg.draft_layer_ids, d2t=d2t,
                                      t2d=t2d, ttt_steps=t.ttt_steps, attn_impl=attn_impl)
        return model, layer

    def build_model(self, attn_impl: str):
        """(model, base config of the export): a fresh draft of the verifier's MLA geometry at train.* heads / MLP,
        or the --finetune-from MLA draft (lightseekorg's published layout or our export) at its own dims, on the
        vocab/ map (its lm_head rows remapped when 03 rebuilt the map)."""
        from . import draft_mla
        from .draft import DraftFormatError

        cfg = self.cfg
        dd, s, t = DataDir(cfg.data_dir), cfg.shared, cfg.train
        summary = load_vocab_summary(dd.vocab_summary)
        d2t, t2d = load_vocab_mapping(dd.vocab_mapping, s.vocab_size, s.draft_vocab_size)
        ids = cfg.draft_layer_ids
        torch.manual_seed(s.seed)  # a fresh draft's initial weights
        try:
            if not t.finetune_from:
                model, layer = self.new_model(d2t, t2d, attn_impl)
                log.info("new MLA draft: %d heads, q_lora %s, kv_lora %d, nope / rope / v %d / %d / %d, MLP %d, draft "
                         "vocab %d (vocab/ source: %s)", layer.num_attention_heads, layer.q_lora_rank,
                         layer.kv_lora_rank, layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.v_head_dim,
                         layer.intermediate_size, d2t.shape[0], summary.source)
                return model, None
            check_warm_start_vocab(cfg, summary)
            ckpt = draft_mla.read_checkpoint(t.finetune_from)
            where = f"--finetune-from {t.finetune_from}"
            if int(ckpt.config["hidden_size"]) != s.hidden_size or int(ckpt.config["vocab_size"]) != s.vocab_size:
                raise StageError(f"{where}: hidden_size {ckpt.config['hidden_size']} / vocab_size "
                                 f"{ckpt.config['vocab_size']}, this run's verifier has {s.hidden_size} / "
                                 f"{s.vocab_size} (--hidden-size, --vocab-size): a draft of another model")
            check_aux_ids(warm_start_aux_ids(cfg, ckpt.aux_layer_ids), ids, t.finetune_from)
            layer = draft_mla.layer_config_from_checkpoint(ckpt.config)
            model = draft_mla.build_model(layer, verifier=s.verifier, aux_layer_ids=ids, d2t=d2t, t2d=t2d,
                                          ttt_steps=t.ttt_steps, attn_impl=attn_impl)
            info = draft_mla.load_into_model(model, ckpt)
        except DraftFormatError as e:
            raise StageError(str(e)) from None
        if summary.source == "checkpoint" and info["remapped"]:
            raise StageError(f"{dd.vocab} says it kept the map of {t.finetune_from} but differs from it: rerun 03")
        log.info("warm start from %s (MLA, %d tensors loaded key by key; vocab %s%s)", t.finetune_from,
                 len(info["keys"]), summary.source,
                 f", {info['shared']} lm_head rows kept, the rest the verifier's" if info["remapped"] else "")
        return model, ckpt.config

    def export(self, model, out_dir: Path, base_config: dict | None) -> Path:
        from . import draft_mla

        return draft_mla.export(model, out_dir, self.cfg.draft_layer_ids, base_config)


class DFlashFamily:
    """speculators' DFlashDraftModel: random anchored blocks per row, its loss and per-slot weights, eal; exported
    in speculators' format for vLLM's dflash method."""

    name = "dflash"

    def __init__(self, cfg: PipelineConfig, device: torch.device):
        from . import draft_dflash

        self.cfg, self.device = cfg, device
        t = cfg.train
        self.block_size = t.dflash_block_size
        self.anchors = draft_dflash.max_anchors(t.total_seq_len, t.dflash_max_anchors)
        self.keys = dflash_metric_keys(self.block_size)
        self.loss_name = f"{t.dflash_loss} with {t.dflash_position_weight} slot weights ({self.anchors} blocks a row)"

    def call_kwargs(self, loss_config: dict) -> dict:  # noqa: ARG002 (train.loss is EAGLE-3's; DFlash has its own)
        """The forward's keyword arguments: speculators' own for DFlash (train.dflash_loss, position weight, gamma,
        anchors)."""
        from . import draft_dflash

        t = self.cfg.train
        return draft_dflash.trainer_kwargs(loss=t.dflash_loss, position_weight=t.dflash_position_weight,
                                           gamma=t.dflash_gamma, anchors=self.anchors)

    def summarize(self, totals: dict) -> dict:
        return summarize_dflash(totals, self.block_size)

    def progress_fields(self, row: dict) -> dict:
        return {"loss": f"{row['loss']:.3f}", "eal": f"{row['eal']:.2f}", "acc": f"{row['acc']:.3f}"}

    def row_rng(self, epoch, position: int):
        return seeded_rng(anchor_seed(self.cfg.shared.seed, epoch, position), self.device)

    def identity(self) -> dict:
        t = self.cfg.train
        path = DataDir(self.cfg.data_dir).vocab_summary
        if not path.exists():  # a StageError: rank 0 runs this alone and tells the other ranks (train.on_rank0)
            raise StageError(f"{path} not found: run 03_build_vocab_mapping.py --draft dflash first")
        summary = load_vocab_summary(path)
        return {"train.draft": self.name, "train.draft_layer_ids": self.cfg.draft_layer_ids,
                "train.dflash": {"block_size": t.dflash_block_size, "num_layers": t.dflash_num_layers,
                                 "num_kv_heads": t.dflash_num_kv_heads, "max_anchors": self.anchors,
                                 "loss": t.dflash_loss, "position_weight": t.dflash_position_weight,
                                 "gamma": t.dflash_gamma, "mask_token_id": summary.mask_token_id}}

    def new_model(self, d2t: torch.Tensor, t2d: torch.Tensor, attn_impl: str, mask_token_id: int = 0):
        """A new draft at train.* dims on the vocab map (d2t, t2d): what 04 trains without --finetune-from, and
        what ``run_all.sh --plan`` sizes (built on the meta device: costs.draft_size)."""
        from . import draft_dflash

        s, t = self.cfg.shared, self.cfg.train
        layer = draft_dflash.layer_config(s.verifier, num_layers=t.dflash_num_layers, num_heads=t.draft_num_heads,
                                          head_dim=t.draft_head_dim, num_kv_heads=t.dflash_num_kv_heads,
                                          intermediate_size=t.draft_intermediate_size,
                                          trust_remote_code=s.trust_remote_code)
        if layer.num_attention_heads % layer.num_key_value_heads:
            raise StageError(f"a DFlash draft of {layer.num_attention_heads} heads cannot share keys/values "
                             f"among {layer.num_key_value_heads} KV heads: set --dflash-num-kv-heads to a "
                             "divisor of --draft-num-heads (0 = as many as the heads)")
        model = draft_dflash.build_model(layer, verifier=s.verifier, layer_ids=self.cfg.draft_layer_ids, d2t=d2t,
                                         t2d=t2d, block_size=self.block_size, mask_token_id=mask_token_id,
                                         attn_impl=attn_impl)
        return model, layer

    def build_model(self, attn_impl: str):
        """(model, None): a fresh draft at train.* dims, or the --finetune-from draft (z-lab's or speculators'
        format) at its own dims; on the vocab/ map, with the mask token 03 resolved."""
        from . import draft_dflash
        from .draft import DraftFormatError, verifier_text_config

        cfg = self.cfg
        dd, s, t = DataDir(cfg.data_dir), cfg.shared, cfg.train
        summary = load_vocab_summary(dd.vocab_summary)
        if summary.mask_token_id < 0:
            raise StageError(f"{dd.vocab_summary} names no DFlash mask token: rerun 03_build_vocab_mapping.py "
                             f"--draft dflash (it resolves vocab.mask_token, {cfg.vocab.mask_token!r}, by name)")
        d2t, t2d = load_vocab_mapping(dd.vocab_mapping, s.vocab_size, s.draft_vocab_size)
        ids = cfg.draft_layer_ids
        torch.manual_seed(s.seed)  # a fresh draft's initial weights
        if not t.finetune_from:
            model, layer = self.new_model(d2t, t2d, attn_impl, summary.mask_token_id)
            log.info("new DFlash draft: %d layers of %d heads x %d (%d KV), MLP %d; block %d (k = %d), %d anchors a "
                     "row; reads layers %s; mask token %r = %d; draft vocab %d", layer.num_hidden_layers,
                     layer.num_attention_heads, layer.head_dim, layer.num_key_value_heads, layer.intermediate_size,
                     self.block_size, self.block_size - 1, self.anchors, ids, summary.mask_token,
                     summary.mask_token_id, d2t.shape[0])
            return model, None
        num_layers = verifier_text_config(s.verifier, s.trust_remote_code).num_hidden_layers
        try:
            ckpt = draft_dflash.read_checkpoint(t.finetune_from, num_layers)
        except DraftFormatError as e:
            raise StageError(str(e)) from None
        where = f"--finetune-from {t.finetune_from}"
        if ckpt.layer_ids != ids:
            said = f" (z-lab's target_layer_ids {[k - 1 for k in ckpt.layer_ids]} + 1)" if ckpt.source == "zlab" else ""
            raise StageError(f"{where}: reads the states entering layers {ckpt.layer_ids}{said}, this run's draft "
                             f"reads {ids} (train.draft_layer_ids / shared.aux_layer_ids): extract those layers")
        if ckpt.block_size != self.block_size:
            raise StageError(f"{where}: block size {ckpt.block_size}, train.dflash_block_size is {self.block_size}")
        if ckpt.mask_token_id != summary.mask_token_id:
            raise StageError(f"{where}: mask token id {ckpt.mask_token_id}, vocab/ resolved {summary.mask_token!r} = "
                             f"{summary.mask_token_id}: set vocab.mask_token to its token and rerun 03")
        if int(ckpt.layer.get("hidden_size", -1)) != s.hidden_size:
            raise StageError(f"{where}: hidden_size {ckpt.layer.get('hidden_size')}, the verifier's is {s.hidden_size}")
        layer = draft_dflash.layer_config_from_checkpoint(ckpt)
        model = draft_dflash.build_model(layer, verifier=s.verifier, layer_ids=ids, d2t=d2t, t2d=t2d,
                                         block_size=ckpt.block_size, mask_token_id=ckpt.mask_token_id,
                                         attn_impl=attn_impl)
        try:
            info = draft_dflash.load_into_model(model, ckpt)
        except DraftFormatError as e:
            raise StageError(str(e)) from None
        log.info("warm start from %s (%s format): %d layers of %d heads x %d, lm_head: %s", t.finetune_from,
                 ckpt.source, layer.num_hidden_layers, layer.num_attention_heads, layer.head_dim, info["lm_head"])
        return model, None

    def export(self, model, out_dir: Path, base_config: dict | None) -> Path:  # noqa: ARG002
        from . import draft_dflash

        return draft_dflash.export(model, out_dir)

    def plot(self, metrics_path: Path, out_png: Path) -> None:
        plot_dflash_curves(metrics_path, out_png, self.block_size)


FAMILIES = {"eagle3": Eagle3Family, "eagle3_mla": Eagle3MLAFamily, "dflash": DFlashFamily}  # by train.draft


def draft_family(cfg: PipelineConfig, device: torch.device):
    return FAMILIES[cfg.train.draft](cfg, device)
