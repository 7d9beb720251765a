"""Hugging Face checkpoints in and out (dtp.models.hf): tiny random models made here with
transformers (nothing downloaded) give the same logits under dtp as under transformers
(fp64 models; transformers computes RoPE in fp32, hence 1e-6), for Llama with and without
Llama 3.1 rope scaling, tied and untied, GQA, an explicit head_dim, a transformers-4
config.json, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE (MoE in every layer and
renormalised, or every second layer, not renormalised, with biases) and Llama's
attention_bias (biases and q/k norms drawn away from their 0 / 1 init); ``to_hf`` writes what transformers loads to the same logits and
``from_hf`` reads back bit-exactly; a greedy continuation equals ``generate``; a padded
vocabulary changes neither the loss nor its gradients, under vocab-parallel tp too.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import optree
import pytest
import torch

from dtp.models import hf, llama
from dtp.testing import reference_value_and_grad, run

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

V = 100
ATOL = 1e-6  # transformers' RoPE is fp32 even in an fp64 model
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}
CASES = {
    "gqa": dict(num_key_value_heads=2),
    "mha_tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "llama3_rope": dict(num_key_value_heads=2, rope_scaling=LLAMA3),
    "llama3_rope_tied": dict(num_key_value_heads=1, rope_scaling=LLAMA3, tie_word_embeddings=True),
    "head_dim": dict(num_key_value_heads=2, head_dim=16),
    "mixtral": dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "mistral": dict(num_key_value_heads=2, sliding_window=64),  # longer than TOKENS: plain causal
    # Qwen2's defaults: rope_theta 1e6, a sliding_window that use_sliding_window=False turns off
    "qwen2": dict(num_key_value_heads=2, rope_theta=1e6, sliding_window=8, use_sliding_window=False,
                  max_window_layers=1),
    "qwen2_tied": dict(num_key_value_heads=1, tie_word_embeddings=True),
    "qwen3": dict(num_key_value_heads=2, head_dim=16),
    "qwen3_bias": dict(num_key_value_heads=2, head_dim=8, attention_bias=True),
    "llama_bias": dict(num_key_value_heads=2, attention_bias=True),
    # Qwen3-MoE: experts narrower than the dense MLP; sparse2: MoE in layers 1 and 3 of 4
    "qwen3moe": dict(num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=24, norm_topk_prob=True),
    "qwen3moe_sparse2": dict(num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=24, norm_topk_prob=False, decoder_sparse_step=2,
                             num_hidden_layers=4, attention_bias=True),
}
_CLASSES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
            "mistral": ("MistralConfig", "MistralForCausalLM"), "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
            "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}


def _hf_model(case: str) -> torch.nn.Module:
    kw = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              rope_theta=500.0)
    kw.update(CASES[case])
    torch.manual_seed(sum(map(ord, case)))
    config, model = _CLASSES.get(case.split("_")[0], ("LlamaConfig", "LlamaForCausalLM"))
    cfg = getattr(transformers, config)(**kw)
    if "num_experts_per_tok" in kw:
        cfg._experts_implementation = "eager"  # the grouped-mm kernel has no fp64
    model = getattr(transformers, model)(cfg)
    with torch.no_grad():  # transformers starts biases at 0 and q/k norms at 1: draw them, so they count
        for name, p in model.named_parameters():  # (in fp32, as the weights: fp32 round trips stay exact)
            if name.endswith("bias") or "_norm." in name:
                p.add_(0.3 * torch.randn_like(p))
    return model.double().eval()


@functools.cache
def _saved(case: str, root: Path) -> Path:
    path = root / case
    _hf_model(case).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf")


def _load(path: Path) -> torch.nn.Module:
    cls = transformers.AutoModelForCausalLM
    kw = {"experts_implementation": "eager"} if "mixtral" in path.name or "moe" in path.name else {}
    return cls.from_pretrained(path, dtype=torch.float64, **kw).eval()


TOKENS = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("case", sorted(CASES))
def test_from_hf_logits_equal_transformers(case: str, root: Path) -> None:
    path = _saved(case, root)
    cfg, params = hf.from_hf(path, dtype=torch.float64)
    with torch.no_grad():
        expected = _load(path)(TOKENS).logits
    torch.testing.assert_close(llama.apply(params, TOKENS, cfg), expected, atol=ATOL, rtol=0)
    if "llama3" in case:  # the scaling is really applied: without it the logits differ
        plain = llama.apply(params, TOKENS, dataclasses.replace(cfg, rope_scaling=None))
        assert (plain - expected).abs().max() > 100 * ATOL
    if cfg.pre_softmax:  # Qwen3-MoE's norm_topk_prob=false counts: renormalised, the logits differ
        renormalised = llama.apply(params, TOKENS, dataclasses.replace(cfg, pre_softmax=False))
        assert (renormalised - expected).abs().max() > 100 * ATOL


def test_transformers_4_config_form_reads_the_same(root: Path, tmp_path: Path) -> None:
    src = _saved("llama3_rope", root)
    hf_cfg = json.loads((src / "config.json").read_text())
    rope = hf_cfg.pop("rope_parameters")
    hf_cfg.update(rope_theta=rope.pop("rope_theta"), rope_scaling={**rope, "type": rope.pop("rope_type")})
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    (tmp_path / "model.safetensors").symlink_to(src / "model.safetensors")
    assert hf.from_hf(tmp_path)[0] == hf.from_hf(src)[0]


@pytest.mark.parametrize("case", ["llama3_rope_tied", "gqa", "mixtral", "qwen2", "qwen3_bias", "llama_bias",
                                  "qwen3moe_sparse2"])
def test_to_hf_loads_in_transformers_and_round_trips_bit_exactly(case: str, root: Path, tmp_path: Path) -> None:
    src = _saved(case, root)
    cfg, params = hf.from_hf(src, dtype=torch.float32, vocab_multiple=64)  # pad 100 -> 128, stripped again
    out = tmp_path / case
    files = hf.to_hf(cfg, params, out, max_shard_bytes=16_000)
    assert len(files) > 1 and (out / "model.safetensors.index.json").is_file()
    with torch.no_grad():
        torch.testing.assert_close(_load(out)(TOKENS).logits, _load(src)(TOKENS).logits, atol=0, rtol=0)
    assert hf.from_hf(out, vocab_multiple=64)[0] == cfg
    with safetensors.safe_open(str(src / "model.safetensors"), "pt") as a:
        index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert sorted(index) == sorted(a.keys())  # per-expert keys, as stored
        for name in a.keys():
            with safetensors.safe_open(str(out / index[name]), "pt") as b:
                assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name


def test_qwen2_export_says_qwen2_with_its_fields(root: Path, tmp_path: Path) -> None:
    """The export's config.json names Qwen2 (before, every dense model was written as a
    Llama, which has no biases) with Qwen2's rope_theta, tied head and full attention."""
    for case in ("qwen2", "qwen2_tied"):
        cfg, params = hf.from_hf(_saved(case, root))
        hf.to_hf(cfg, params, tmp_path / case)
        src, out = (json.loads((p / "config.json").read_text()) for p in (_saved(case, root), tmp_path / case))
        assert (out["model_type"], out["architectures"]) == ("qwen2", ["Qwen2ForCausalLM"])
        assert out["use_sliding_window"] is False and out["max_window_layers"] == 2
        assert {k: out[k] for k in ("rope_theta", "tie_word_embeddings")} == {
            "rope_theta": src["rope_parameters"]["rope_theta"], "tie_word_embeddings": src["tie_word_embeddings"]}
        assert "attention_bias" not in out  # Qwen2's biases are its architecture's, not a flag


@pytest.mark.parametrize("change, match", [(dict(o_bias=True), "qkv_bias=False, o_bias=True"),
                                           (dict(qk_norm=True, qkv_bias=True), "qkv_bias=True, o_bias=False"),
                                           (dict(num_experts=4, qkv_bias=True), "Mixtral's attention has no biases")])
def test_to_hf_refuses_attention_extras_no_architecture_has(tmp_path: Path, change: dict, match: str) -> None:
    cfg = llama.config("tiny", **change)
    with pytest.raises(ValueError, match=match):
        hf.to_hf(cfg, llama.init(cfg), tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything is written


def _greedy(params: dict, cfg: llama.LlamaConfig, tokens: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):  # the whole prefix again each time: no KV cache to get wrong
        nxt = llama.apply(params, tokens, cfg)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens


@pytest.mark.parametrize("case", ["llama3_rope", "mixtral"])
def test_greedy_continuation_equals_generate(case: str, root: Path) -> None:
    path = _saved(case, root)
    cfg, params = hf.from_hf(path, dtype=torch.float64, vocab_multiple=64)
    prompt = TOKENS[:, :6]
    expected = _load(path).generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                                    do_sample=False, pad_token_id=0)
    assert torch.equal(_greedy(params, cfg, prompt, 8), expected)


def test_padded_vocabulary_changes_no_loss_and_no_gradient(root: Path) -> None:
    path = _saved("gqa", root)
    batch = {"tokens": TOKENS[:, :-1], "targets": TOKENS[:, 1:]}
    (cfg, params), (pcfg, padded) = hf.from_hf(path, torch.float64), hf.from_hf(path, torch.float64, 64)
    assert pcfg.vocab_size == 128 and pcfg.vocab_pad == 28
    loss, grads = reference_value_and_grad(functools.partial(llama.loss, cfg=cfg), params, batch)
    ploss, pgrads = reference_value_and_grad(functools.partial(llama.loss, cfg=pcfg), padded, batch)
    assert ploss == loss
    torch.testing.assert_close(pgrads["embed"][:V], grads["embed"], atol=1e-15, rtol=0)
    assert not pgrads["embed"][V:].any() and not pgrads["lm_head"][:, V:].any()


def _tp4_loss(cfg: llama.LlamaConfig, params: dict, batch: dict) -> tuple[float, torch.Tensor]:
    import dtp
    import dtp.step

    state = dtp.TrainState.create(params, dtp.optim.sgd(0.0), mesh=dtp.make_mesh(tp=4),
                                  layout=dtp.layouts.megatron(), axes=llama.param_axes(cfg),
                                  axis_sizes=llama.axis_sizes(cfg))
    loss, _, grads = dtp.step.value_and_grad(functools.partial(llama.loss, cfg=cfg), state, dtp.shard_batch(batch, state))
    return float(loss), grads["embed"].to_local()  # this rank's 64 vocab rows (tied: the head's too)


def test_padded_vocabulary_under_vocab_parallel_tp4(root: Path) -> None:
    """100 rows padded to 256 over tp 4: two ranks hold only padding columns."""
    path = _saved("mha_tied", root)
    batch = {"tokens": TOKENS[:, :-1].contiguous(), "targets": TOKENS[:, 1:].contiguous()}
    cfg, params = hf.from_hf(path, torch.float64)
    pcfg, padded = hf.from_hf(path, torch.float64, vocab_multiple=256)
    expected = float(llama.loss(params, batch, cfg))
    results = run(_tp4_loss, pcfg, padded, batch, world_size=4)
    grad = torch.cat([g for _, g in results])
    assert all(abs(loss - expected) <= 1e-12 for loss, _ in results)
    assert torch.isfinite(grad).all() and grad[:V].any() and not grad[V:].any()


@pytest.mark.parametrize("change, match", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ({"model_type": "mistral", "attention_bias": True}, "attention_bias=true is not supported for 'mistral'"),
    ({"hidden_act": "gelu"}, "hidden_act must be 'silu'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope type 'yarn'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
])
def test_unsupported_configs_are_refused(root: Path, change: dict, match: str) -> None:
    hf_cfg = {**json.loads((_saved("gqa", root) / "config.json").read_text()), **change}
    with pytest.raises(ValueError, match=match):
        hf.config_from_hf(hf_cfg)


def _damaged(root: Path, tmp_path: Path, damage: str) -> Path:
    """A copy of the "gqa" model whose weights are cut short (``truncated``: the header
    whole, tensor data missing; ``header``: cut inside the header) or lack a tensor."""
    import shutil

    path = tmp_path / damage
    shutil.copytree(_saved("gqa", root), path)
    weights = path / "model.safetensors"
    if damage == "missing":
        from safetensors.torch import load_file, save_file

        tensors = load_file(weights)
        del tensors["model.layers.1.mlp.up_proj.weight"]
        save_file(tensors, weights, metadata={"format": "pt"})
    else:
        data = weights.read_bytes()
        weights.write_bytes(data[:len(data) // 2] if damage == "truncated" else data[:40])
    return path


_DAMAGE = {"truncated": "model.safetensors is cut short: its header describes",
           "header": "model.safetensors is not a whole .safetensors file",
           "missing": "has no tensor 'model.layers.1.mlp.up_proj.weight'"}


@pytest.mark.parametrize("damage", sorted(_DAMAGE))
def test_damaged_weights_are_a_value_error_naming_the_file(root: Path, tmp_path: Path, damage: str) -> None:
    # Before, a truncated file raised safetensors' SafetensorError (no ValueError): a
    # `dtp train --init-from` rank crashed (exit 1) instead of one line, exit 2.
    with pytest.raises(ValueError, match=_DAMAGE[damage]):
        hf.from_hf(_damaged(root, tmp_path, damage), torch.float64)


def _from_hf_error(path: str) -> str:
    import dtp

    mesh = dtp.make_mesh(dp=2, tp=2)
    layout = dtp.layouts.data() + dtp.layouts.megatron()
    try:
        dtp.TrainState.from_hf(path, dtp.optim.adamw(1e-3), mesh=mesh, layout=layout, dtype=torch.float64)
    except ValueError as e:
        return str(e)
    return "loaded"


def test_damaged_weights_fail_alike_on_every_rank_and_dtp_train_says_one_line(root: Path, tmp_path: Path,
                                                                            monkeypatch, capsys) -> None:
    from dtp import cli

    path = _damaged(root, tmp_path, "truncated")
    errors = run(_from_hf_error, str(path), world_size=4)
    assert len(set(errors)) == 1 and _DAMAGE["truncated"] in errors[0], errors
    missing = _damaged(root, tmp_path, "missing")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    data = tmp_path / "tokens.npy"
    np = pytest.importorskip("numpy")
    np.save(data, torch.randint(0, V, (4096,), generator=torch.Generator().manual_seed(1)).numpy())
    # The cut file before any rank starts (its header against its size); the missing tensor
    # by the rank's loader, in its own words (before: TrainState.from_hf: "from_hf: ...", a
    # KeyError's quotes).
    for damaged, says in ((path, f"--init-from {path}: {path}/model.safetensors is cut short"),
                          (missing, f"from_hf: {missing} has no tensor 'model.layers.1.mlp.up_proj.weight'")):
        flags = ["train", "--init-from", str(damaged), "--data", str(data), "--steps", "1", "--batch", "2", "--seq",
                 "16", "--out", str(tmp_path / f"run-{damaged.name}")]
        assert cli.main(flags) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"dtp train: error: {says}"), err


@pytest.mark.parametrize("change", [dict(shared_experts=1), dict(routed_scaling_factor=2.5),
                                    dict(router_score="sigmoid", router_bias_update=1e-2),
                                    dict(n_groups=2, topk_group=1)], ids=lambda c: next(iter(c)))
def test_to_hf_refuses_what_mixtral_cannot_express(tmp_path: Path, change: dict) -> None:
    # Each routes tokens otherwise than Mixtral's router: an export would load as another
    # model (before, the DeepSeek-style options were written as a plain Mixtral).
    cfg = llama.config("tiny-moe", **change)
    with pytest.raises(ValueError, match=f"this model sets .*{next(iter(change))}"):
        hf.to_hf(cfg, llama.init(cfg), tmp_path)
    assert hf.hf_config(llama.config("tiny-moe", routed_scaling_factor=1.0))["model_type"] == "mixtral"


@pytest.mark.parametrize("case", ["gqa", "qwen2", "qwen3moe_sparse2"])
def test_dtp_train_init_from_then_export_loads_in_transformers(root: Path, tmp_path: Path, monkeypatch,
                                                               case: str) -> None:
    """Fine-tune a transformers-made model for a step on one process, save, ``dtp export
    --hf``: transformers loads the export, and its logits are the trained parameters'; the
    source's special-token ids and generation config come along (before, the export's
    config.json had none, so transformers' defaults, bos 1 / eos 2, stopped generation at
    another id than a Llama 3's)."""
    import shutil

    from dtp import cli

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    src, run, out = tmp_path / case, tmp_path / "run", tmp_path / f"{case}-ft"
    shutil.copytree(_saved(case, root), src)
    ids = {"bos_token_id": 4, "eos_token_id": [5, 6], "pad_token_id": 0}
    (src / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), **ids}))
    (src / "generation_config.json").write_text(json.dumps({**ids, "max_new_tokens": 7}))
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 16}))  # AutoTokenizer's files
    flags = ["--init-from", str(src), "--steps", "1", "--batch", "4", "--seq", "16", "--dtype", "float64",
             "--save-every", "1", "--out", str(run)]
    data = tmp_path / "tokens.npy"
    np = pytest.importorskip("numpy")
    np.save(data, torch.randint(0, V, (4096,), generator=torch.Generator().manual_seed(1)).numpy())
    assert cli.main(["train", *flags, "--data", str(data)]) == 0
    assert cli.main(["export", "--hf", str(out), "--run", str(run)]) == 0
    cfg, params = hf.from_hf(out, dtype=torch.float64)
    assert cfg == hf.from_hf(src)[0] and not torch.equal(params["embed"], hf.from_hf(src, torch.float64)[1]["embed"])
    loaded = _load(out)
    with torch.no_grad():
        torch.testing.assert_close(loaded(TOKENS).logits, llama.apply(params, TOKENS, cfg), atol=ATOL, rtol=0)
    written = json.loads((out / "config.json").read_text())
    assert {k: written.get(k) for k in ids} == ids
    assert loaded.generation_config.eos_token_id == [5, 6] and loaded.generation_config.max_new_tokens == 7
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"model_max_length": 16}  # carried too


def _cut_init_from_run(root: Path, tmp_path: Path, monkeypatch) -> tuple[list[str], Path, Path, Path]:
    """An ``--init-from`` run of 4 fp64 steps saved every 2 (``whole``), a copy of it stopped
    after step 2 (``cut``: its last checkpoint and metrics gone), and then its weight file
    damaged: the flags, ``whole``, ``cut`` and the weight file."""
    import shutil

    from dtp import cli

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    src, whole, cut = tmp_path / "gqa", tmp_path / "whole", tmp_path / "cut"
    shutil.copytree(_saved("gqa", root), src)
    data = tmp_path / "tokens.npy"
    np = pytest.importorskip("numpy")
    np.save(data, torch.randint(0, V, (4096,), generator=torch.Generator().manual_seed(1)).numpy())
    flags = ["--init-from", str(src), "--data", str(data), "--steps", "4", "--batch", "4", "--seq", "16",
             "--dtype", "float64", "--save-every", "2", "--log-every", "4"]
    assert cli.main(["train", *flags, "--out", str(whole)]) == 0
    shutil.copytree(whole, cut)
    shutil.rmtree(cut / "checkpoints" / "step_00000004")
    (cut / "metrics.jsonl").write_text("".join((whole / "metrics.jsonl").read_text().splitlines(True)[:2]))
    weights = src / "model.safetensors"
    weights.write_bytes(b"\0" * weights.stat().st_size)  # not a safetensors file any more
    return flags, whole, cut, weights


def _losses(*runs: Path) -> list[list[float]]:
    return [[json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()] for run in runs]


def test_a_resume_of_an_init_from_run_reads_no_weight_file(root: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """``--resume`` of an ``--init-from`` run takes the parameters from its checkpoint: with
    the weight files damaged it continues the uninterrupted run's curve exactly (fp64,
    resumed under dp2 ZeRO-1, whose state is cut from the file's blocks). Before, the
    preflight refused the file and every rank read its blocks, only to replace them.
    ``--check`` still needs them (its reference retrains from them), and says so."""
    import cli_pool
    from dtp import cli

    flags, whole, cut, weights = _cut_init_from_run(root, tmp_path, monkeypatch)
    capsys.readouterr()
    assert cli.main(["train", *flags, "--resume", "--check", "--out", str(cut)]) == 2
    assert capsys.readouterr().err.startswith(f"dtp train: error: --init-from {weights.parent}: {weights} is not a whole")
    proc = cli_pool.train(monkeypatch, *flags, "--nproc", "2", "--dp", "2", "--zero", "1", "--resume",
                          "--out", str(cut))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = _losses(cut, whole)
    assert len(losses[0]) == 4 and losses[0] == pytest.approx(losses[1], rel=1e-10, abs=0)


def test_a_torchrun_restart_of_an_init_from_run_reads_no_weight_file(root: Path, tmp_path: Path, monkeypatch,
                                                                     capsys) -> None:
    """A rank that torchrun restarted (``--max-restarts``: the same command, no ``--resume``,
    ``TORCHELASTIC_RESTART_COUNT`` > 0) resumes from the run directory's newest checkpoint,
    so its preflight checks no weight file either: with the file damaged it continues the
    uninterrupted curve exactly. Before, every restarted rank refused the file (exit 2)
    and torchrun spent its restarts on that. A restart with no checkpoint yet trains from
    the weight files, and still checks them."""
    from dtp import cli, testing

    flags, whole, cut, weights = _cut_init_from_run(root, tmp_path, monkeypatch)
    # What torchrun gives the one rank of a --nproc-per-node 1 run it restarted once.
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(testing._free_port()),
                 "TORCHELASTIC_RESTART_COUNT": "1"}.items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    assert cli.main(["train", *flags, "--out", str(cut)]) == 0, capsys.readouterr().err
    losses = _losses(cut, whole)
    assert len(losses[0]) == 4 and losses[0] == pytest.approx(losses[1], rel=1e-10, abs=0)
    capsys.readouterr()
    assert cli.main(["train", *flags, "--out", str(tmp_path / "fresh")]) == 2
    assert capsys.readouterr().err.startswith(f"dtp train: error: --init-from {weights.parent}: {weights} is not a whole")


def test_a_sequence_past_a_mistrals_window_is_refused(root: Path, tmp_path: Path, capsys) -> None:
    """dtp's attention has no sliding window: within it a Mistral is plain causal, past it
    the run would train another model, so ``--seq`` past the window is a usage error."""
    from dtp import cli

    data = tmp_path / "tokens.npy"
    np = pytest.importorskip("numpy")
    np.save(data, torch.randint(0, V, (4096,), generator=torch.Generator().manual_seed(1)).numpy())
    flags = ["train", "--init-from", str(_saved("mistral", root)), "--data", str(data), "--steps", "1", "--batch", "2",
             "--out", str(tmp_path / "run")]
    assert cli.main([*flags, "--seq", "128"]) == 2
    assert "--seq 128: longer than the 64 tokens --init-from" in capsys.readouterr().err


def _sharded_load(path: str, zero: int) -> dict:
    """On a dp2 × tp2 rank: TrainState.from_hf's pieces against create's, the bytes read,
    and a step's loss."""
    import dtp
    from dtp.models import hf as hf_mod

    layout = dtp.layouts.data() + dtp.layouts.megatron() + (dtp.layouts.zero(zero) if zero else dtp.Layout())
    mesh, opt = dtp.make_mesh(dp=2, tp=2), dtp.optim.adamw(1e-3)
    before = hf_mod.bytes_read()
    state = dtp.TrainState.from_hf(path, opt, mesh=mesh, layout=layout, dtype=torch.float64)
    read = hf_mod.bytes_read() - before
    cfg, params = hf_mod.from_hf(path, dtype=torch.float64)
    whole = dtp.TrainState.create(params, opt, mesh=mesh, layout=layout, axes=llama.param_axes(cfg),
                                  axis_sizes=llama.axis_sizes(cfg))
    mine = [x.to_local() for x in optree.tree_leaves(state.params)]
    same = all(torch.equal(a, b.to_local()) for a, b in zip(mine, optree.tree_leaves(whole.params)))
    batch = {"tokens": TOKENS[:, :-1].contiguous(), "targets": TOKENS[:, 1:].contiguous()}
    losses = [float(dtp.train_step(functools.partial(llama.loss, cfg=cfg), s, dtp.shard_batch(batch, s))[1]["loss"])
              for s in (state, whole)]
    return {"same": same, "read": read, "local": sum(x.numel() * 8 for x in mine), "losses": losses}


def test_sharded_load_reads_only_each_ranks_blocks(root: Path) -> None:
    """dp2 × tp2: each rank reads exactly its blocks (1/tp of every split matrix, norms
    whole), about 0.55 of the file here; the state equals create's and trains the same.
    (ZeRO and pipelines: tests/test_hf_sharded.py.)"""
    path = _saved("mha_tied", root)  # 4 kv heads: tp2 splits them
    total = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    for r in run(_sharded_load, str(path), 0, world_size=4):
        assert r["same"] and r["losses"][0] == r["losses"][1]
        assert r["read"] == r["local"] and r["read"] < 0.6 * total, (r["read"], total)


def _checkpointed_run(run: Path, **record) -> tuple[llama.LlamaConfig, dict]:
    """A run directory holding one checkpoint of a tiny MoE model (as dtp train saves it;
    ``record``: more of the run's flags than its dtype)."""
    import dataclasses as dc

    import dtp
    from dtp.cli.loop import single_process_world

    cfg = llama.config("tiny-moe", n_layers=2, vocab_size=V)
    params = llama.init(cfg, dtype=torch.float64)
    with single_process_world() as mesh:  # leaves no process group behind
        state = dtp.TrainState.create(params, dtp.optim.adamw(1e-3), mesh=mesh, layout=dtp.layouts.data(),
                                      axes=llama.param_axes(cfg))
        dtp.checkpoint.save(state, run / "checkpoints", extra={"model": dc.asdict(cfg), "run": {"dtype": "float64", **record}})
    return cfg, params


def test_export_refuses_to_write_over_a_run_and_bad_shard_sizes(tmp_path: Path, capsys) -> None:
    """Before, ``--hf`` naming the run itself (or any dtp run directory) wrote the model's
    config.json over the run's record (its segments: --resume and dtp check read them),
    and ``--max-shard-gb 0`` wrote a file per tensor (nan: "cannot convert float NaN to integer")."""
    from dtp import cli

    run = tmp_path / "run"
    _checkpointed_run(run)
    (run / "config.json").write_text('{"segments": []}')
    (run / "metrics.jsonl").write_text("")
    step = next((run / "checkpoints").iterdir())
    for target in (run, step, run / "checkpoints"):
        assert cli.main(["export", "--hf", str(target), "--run", str(run)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--hf {target}: " in err[0] and "dtp train" in err[0], err
    assert (run / "config.json").read_text() == '{"segments": []}' and not list(run.glob("*.safetensors"))
    (tmp_path / "a file").write_text("kept")  # under a file: was NotADirectoryError, "rank 0 failed", exit 1
    assert cli.main(["export", "--hf", str(tmp_path / "a file" / "out"), "--run", str(run)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"dtp export: error: --hf {tmp_path / 'a file' / 'out'}: cannot create or write it (Not a directory)"]
    for size in ("0", "-1", "nan"):
        assert cli.main(["export", "--hf", str(tmp_path / "out"), "--run", str(run), "--max-shard-gb", size]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"dtp export: error: argument --max-shard-gb: expected a finite number > 0, got {size!r} "
                       f"(see dtp export --help)"], err
    assert not (tmp_path / "out").exists()


def test_export_writes_over_a_model_only_with_overwrite_and_only_whole(tmp_path: Path, capsys,
                                                                      monkeypatch) -> None:
    """Before, ``dtp export --hf DIR`` deleted DIR's weight files (all its shards), then
    wrote config.json over the one there, with no flag and no word: exporting a fine-tune
    into the directory it was initialised from (--init-from) lost the original weights,
    and an export that failed midway left neither model."""
    from dtp import cli, checkpoint

    run, out = tmp_path / "run", tmp_path / "model"
    _checkpointed_run(run)
    out.mkdir()
    mine = {"config.json": '{"model_type": "mistral", "user": "precious"}', "README.md": "mine",
            "model-00001-of-00002.safetensors": "old weights", "model-00002-of-00002.safetensors": "old weights"}
    for name, text in mine.items():
        (out / name).write_text(text)
    assert cli.main(["export", "--hf", str(out), "--run", str(run)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"dtp export: error: --hf {out}: holds a model already (config.json, model-00001-of-00002.safetensors, "
        f"model-00002-of-00002.safetensors); add --overwrite to replace it, or name another directory"]
    assert {p.name: p.read_text() for p in out.iterdir()} == mine

    read = checkpoint.ParamReader.read
    calls = []

    def failing(self, name):  # the third tensor's read fails, after two were written
        calls.append(name)
        if len(calls) == 3:
            raise OSError("disk gone")
        return read(self, name)

    monkeypatch.setattr(checkpoint.ParamReader, "read", failing)
    assert cli.main(["export", "--hf", str(out), "--run", str(run), "--overwrite"]) != 0
    assert len(calls) == 3 and {p.name: p.read_text() for p in out.iterdir()} == mine  # as it was, no staging left
    monkeypatch.setattr(checkpoint.ParamReader, "read", read)
    capsys.readouterr()

    (out / ".dtp-staging-killed").mkdir()  # what a writer killed midway left
    (out / "tokenizer.model").write_text("the old model's")  # this run carries no tokenizer
    (out / "tokenizer.json").mkdir()
    assert cli.main(["export", "--hf", str(out), "--run", str(run), "--overwrite"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"dtp export: error: --hf {out}: tokenizer.json is a directory there, where the export writes a file"]
    (out / "tokenizer.json").rmdir()
    assert cli.main(["export", "--hf", str(out), "--run", str(run), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert (out / "README.md").read_text() == "mine"
    assert json.loads((out / "config.json").read_text())["model_type"] != "mistral"
    assert set(hf.from_hf(out)[1]) == set(_checkpointed_run(tmp_path / "again")[1])  # loads whole
    # into the run's own --init-from source: dtp check of the run would read the fine-tune
    _checkpointed_run(tmp_path / "ft", init_from=str(out))
    assert cli.main(["export", "--hf", str(out), "--run", str(tmp_path / "ft"), "--overwrite"]) == 2
    assert "the run's --init-from source" in capsys.readouterr().err


def test_export_of_a_damaged_checkpoint_names_the_file_and_writes_nothing(tmp_path: Path, capsys) -> None:
    """Before, every checkpoint error ended in "a run saves checkpoints with --save-every N",
    a hint for a run without checkpoints, misleading beside a corrupt one."""
    from dtp import cli

    run = tmp_path / "run"
    _checkpointed_run(run)
    data = next((run / "checkpoints").glob("*/*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert cli.main(["export", "--hf", str(tmp_path / "out"), "--run", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"file {data.name} is corrupt (CRC32" in err[0] and "--save-every" not in err[0], err
    assert not (tmp_path / "out").exists()
    assert cli.main(["export", "--hf", str(tmp_path / "out"), "--run", str(tmp_path)]) == 2  # no checkpoint: the hint
    assert capsys.readouterr().err.strip().endswith("a run saves checkpoints with --save-every N")


def test_export_streams_parameters_and_writes_what_to_hf_writes(tmp_path: Path) -> None:
    """``dtp export --hf`` reads the checkpoint one parameter at a time (never the
    optimizer state: ``ParamReader``) and writes the files ``to_hf`` writes from the whole
    tree, byte for byte — Mixtral's per-expert keys from the stacked experts included."""
    from dtp import cli

    cfg, params = _checkpointed_run(tmp_path / "run")
    (tmp_path / "a file").write_text("kept")  # a usage error, the file untouched
    assert cli.main(["export", "--hf", str(tmp_path / "a file"), "--run", str(tmp_path / "run")]) == 2
    assert (tmp_path / "a file").read_text() == "kept"
    assert cli.main(["export", "--hf", str(tmp_path / "out"), "--run", str(tmp_path / "run")]) == 0
    hf.to_hf(cfg, params, tmp_path / "whole")
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


def test_the_export_of_a_packed_run_names_the_eos_it_learnt_to_end_documents_with(tmp_path: Path) -> None:
    """A --document-mask run learnt to end each document with its EOS: the export's
    config.json says eos_token_id, so generate stops there (before, none: transformers'
    default 2), and a --tokenizer's tokenizer_config.json comes along with it. Without
    the mask the run learnt no end, and nothing is named."""
    from dtp import cli

    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1, "<|endoftext|>": 2, "<eos>": 3},
                                                           unk_token="[UNK]"))
    tok.save(str(tmp_path / "tokenizer.json"))
    np = pytest.importorskip("numpy")
    data = tmp_path / "t.bin"
    np.zeros(64, dtype=np.uint16).tofile(data)
    (tmp_path / "t.bin.json").write_text(json.dumps({"eos_id": 7}))
    cases = [({"document_mask": True, "data": None}, 10),  # the bundled corpus: lines of bytes
             ({"document_mask": True, "data": str(data)}, 7),  # the sidecar's
             ({"document_mask": True, "data": str(data), "eos_id": 5}, 5),  # --eos-id's
             ({"document_mask": True, "data": "corpus.txt", "tokenizer": str(tmp_path / "tokenizer.json")}, 2),
             ({"document_mask": False, "data": None}, None)]
    for i, (record, eos) in enumerate(cases):
        run, out = tmp_path / f"run{i}", tmp_path / f"out{i}"
        _checkpointed_run(run, **record)
        assert cli.main(["export", "--hf", str(out), "--run", str(run)]) == 0
        assert json.loads((out / "config.json").read_text()).get("eos_token_id") == eos, record
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    assert cli.main(["export", "--hf", str(tmp_path / "out"), "--run", str(tmp_path / "run3")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == 3
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text()) == {"eos_token": "<eos>"}


def test_the_export_adds_the_trained_eos_beside_the_ids_a_source_named(tmp_path: Path) -> None:
    """An --init-from source's eos_token_id (config.json and generation_config.json, which
    generate reads first) was kept alone even when the run ended its documents with another
    id (--eos-id): generate then never stopped where the model learnt to."""
    from dtp.cli.export import _carry_eos

    def write(config: dict, generation: dict) -> None:
        (tmp_path / "config.json").write_text(json.dumps(config))
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))

    def read() -> tuple:
        return tuple(json.loads((tmp_path / n).read_text()).get("eos_token_id")
                     for n in ("config.json", "generation_config.json"))

    write({"eos_token_id": 5}, {"eos_token_id": [5, 6], "max_new_tokens": 7})
    _carry_eos({"document_mask": True, "eos_id": 2}, tmp_path)
    assert read() == ([5, 2], [5, 6, 2])
    assert json.loads((tmp_path / "generation_config.json").read_text())["max_new_tokens"] == 7
    write({"eos_token_id": 5}, {"eos_token_id": [5, 6]})
    _carry_eos({"document_mask": True, "eos_id": 6}, tmp_path)  # named already in one: the other gains it
    assert read() == ([5, 6], [5, 6])
    _carry_eos({"document_mask": False, "eos_id": 2}, tmp_path)  # no documents: nothing learnt to end them
    assert read() == ([5, 6], [5, 6])
