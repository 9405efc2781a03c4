"""`dapo plan` (dapo_core.planning) against what can be measured here, on CPU, without downloads.

- parameter / gradient / AdamW bytes: exactly what PyTorch allocates (tiny model, a 0.5B- and a 32B-shaped Qwen2 on
  the meta device);
- activations and logits: within 20% of the bytes autograd keeps for backward during the trainer's own forward and
  log-prob computation. CPU has no peak-memory counter, so what is measured is the set of tensors that
  ``torch.autograd.graph.saved_tensors_hooks`` sees being saved (deduplicated by storage, counting each storage's
  ``untyped_storage().nbytes()``, parameters excluded). With gradient checkpointing the forward only saves layer
  boundaries; the layer recomputed in backward is added as the largest single layer of the same run without it;
- checkpoint files: model.safetensors' tensor payload exactly;
- the 32B recipe: the exact count of Qwen2.5-32B, a fitting and a non-fitting plan, the CLI's exit codes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from _tiny import optim_config
from transformers import Qwen2Config, Qwen2ForCausalLM
from typer.testing import CliRunner

from dapo_core.config import load_config
from dapo_core.engines.batch import build_policy_batch
from dapo_core.engines.checkpoint import save_checkpoint
from dapo_core.engines.trainer import PolicyTrainer
from dapo_core.planning import GIB, PUBLIC_CONFIGS, Arch, Hardware, make_plan, param_count, resolve_arch
from dapo_core.planning.arch import arch_from_hf_config
from dapo_core.planning.disk import hf_file_bytes
from dapo_core.planning.trainer_memory import activation_bytes, state_bytes
from dapo_core.warmstart.sft import build_base_model
from flows.cli import app

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()
RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
NO_GPU_LIMITS = "no GPU limits apply"


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """The tiny-dapo config (its base model not built: cwd is empty) and the model the base stage builds from it."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config(recipe="tiny-dapo", env={})
    model, _tok = build_base_model(cfg, seed=0)
    return cfg, model


def qwen2_config(a: Arch) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, tie_word_embeddings=a.tied,
        max_position_embeddings=512,
    )  # fmt: skip


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---------------------------------------------------------------- exact: parameters, gradients, optimizer
def test_tiny_state_bytes_are_exact(tiny):
    cfg, model = tiny
    arch = resolve_arch(cfg)
    assert arch.source.startswith("model.tiny")
    planned = state_bytes(arch, master_dtype="float32", world=1)
    assert param_count(arch) == sum(p.numel() for p in model.parameters())
    assert planned.params == nbytes(model.parameters())
    trainer = PolicyTrainer(model, optim_config(lr=1e-3), micro_batch_size=4)
    batch = build_policy_batch([[5, 6, 7]] * 2, [[8, 9], [10, 11]], pad_token_id=0, group_ids=[0, 0])
    trainer.sft_step(batch)  # one real AdamW step
    assert planned.grads == nbytes(p.grad for p in model.parameters())
    state = trainer.optimizer.state.values()
    assert planned.optimizer == nbytes(t for s in state for t in s.values() if isinstance(t, torch.Tensor))


@pytest.mark.parametrize(
    ("name", "published", "tolerance"), [("Qwen/Qwen2.5-0.5B", 0.49e9, 0.01), ("Qwen/Qwen2.5-32B", 32.76e9, 0.005)]
)
def test_public_shapes_match_a_meta_model(name, published, tolerance):
    arch = PUBLIC_CONFIGS[name]
    with torch.device("meta"):
        model = Qwen2ForCausalLM(qwen2_config(arch))
    assert param_count(arch) == sum(p.numel() for p in model.parameters())
    # published: Qwen2.5-0.5B "0.49B" (2 digits: 1%); Qwen2.5-32B's card says "32.5B" (31.0B non-embedding), its
    # config.json gives exactly 32,763,876,352 (32.76B, within 0.5%)
    assert abs(param_count(arch) - published) / published < tolerance
    for dtype in (torch.float32, torch.bfloat16):
        expected = nbytes(p.to(dtype) for p in model.parameters())
        assert state_bytes(arch, master_dtype=str(dtype).removeprefix("torch."), world=1).params == expected
    assert arch_from_hf_config(model.config, "meta") == arch.__class__(**{**arch.__dict__, "source": "meta"})


# ---------------------------------------------------------------- measured: activations and logits
def _saved_bytes(model: torch.nn.Module, trainer: PolicyTrainer, mb) -> tuple[int, int]:
    """(bytes saved for backward by the trainer's forward + log-probs, the largest single decoder layer's share)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[str, int]] = {}
    where = ["outside"]
    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_pre_hook(lambda *_a, i=i: where.__setitem__(0, f"L{i}")))
        handles.append(layer.register_forward_hook(lambda *_a: where.__setitem__(0, "outside")))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), (where[0], storage.nbytes()))
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = trainer._sampling_logits(mb)
        from dapo_core.algorithm import log_probs_from_logits

        log_probs_from_logits(logits, mb.responses)
    for h in handles:
        h.remove()
    per_layer: dict[str, int] = {}
    for w, b in seen.values():
        per_layer[w] = per_layer.get(w, 0) + b
    layers = [v for k, v in per_layer.items() if k != "outside"]
    return sum(b for _w, b in seen.values()), max(layers, default=0)


SHAPES = [  # (hidden, layers, heads, kv, intermediate, vocab, micro, prompt, response)
    (128, 4, 4, 2, 512, 80, 8, 32, 80),  # the tiny recipe's model
    (64, 2, 4, 2, 256, 8192, 2, 16, 48),  # a small Qwen2 with a big-ish vocabulary: logits dominate
    (96, 3, 6, 2, 384, 2048, 4, 24, 40),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_within_20_percent_of_measured(shape, dtype, checkpointing):
    h, layers, heads, kv, inter, vocab, micro, prompt, response = shape
    arch = Arch(h, layers, heads, kv, inter, vocab, tied=True, head_dim=h // heads)
    prompts, responses = [[3] * prompt] * micro, [[4] * response] * micro
    mb = build_policy_batch(prompts, responses, pad_token_id=0, group_ids=list(range(micro)))

    def measured(gc: bool) -> tuple[int, int]:
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(qwen2_config(arch)).to(dtype)
        trainer = PolicyTrainer(model, optim_config(lr=1e-3), micro_batch_size=micro, gradient_checkpointing=gc)
        return _saved_bytes(model, trainer, mb)

    total, _ = measured(checkpointing)
    if checkpointing:
        total += measured(False)[1]  # the one layer recomputed in backward
    e = torch.tensor([], dtype=dtype).element_size()
    planned = activation_bytes(
        arch, micro=micro, prompt_len=prompt, response_len=response, e=e, checkpointing=checkpointing,
        logits_dtype_bytes=e,
    ).saved  # fmt: skip
    assert abs(planned - total) / total < 0.20, (planned, total)


# ---------------------------------------------------------------- exact: checkpoint files
def test_checkpoint_hf_file_is_exact(tiny, tmp_path):
    cfg, model = tiny
    path = save_checkpoint(tmp_path / "ckpt", 1, model=model, trainer_state={"global_step": 1})
    weights = path / "model.safetensors"
    with weights.open("rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]  # safetensors: u64 header length, JSON header, tensors
    payload = weights.stat().st_size - 8 - header_len
    assert payload == hf_file_bytes(resolve_arch(cfg), "float32")


# ---------------------------------------------------------------- the 32B recipe, every recipe, the CLI
def test_32b_recipe_fits_as_shipped_and_not_on_one_node():
    cfg = load_config(recipe="dapo-qwen2.5-32b", env={})
    shipped = make_plan(cfg, Hardware(nodes=16, gpus_per_node=8, gpu_mem=80 * GIB))
    assert shipped.params == 32_763_876_352 and shipped.fits, shipped.problems
    bad_cfg = load_config(
        recipe="dapo-qwen2.5-32b", env={},
        overrides=["trainer.fsdp.cpu_offload=false", "resources.trainer_world_size=8"],
    )  # fmt: skip
    bad = make_plan(bad_cfg, Hardware(nodes=1, gpus_per_node=8, gpu_mem=80 * GIB))
    assert not bad.fits
    memory = [p for p in bad.problems if p.startswith("trainer GPU memory")]
    assert memory and "trainer.fsdp.cpu_offload=true" in memory[0]


def test_cli_exit_codes_and_json(monkeypatch):
    monkeypatch.chdir(REPO)
    ok = runner.invoke(app, ["plan", "--recipe", "dapo-qwen2.5-32b", "--nodes", "16", "--gpus-per-node", "8"])
    assert ok.exit_code == 0, ok.output
    assert "verdict: fits" in ok.stdout and "32,763,876,352" in ok.stdout
    bad = runner.invoke(
        app,
        ["plan", "--recipe", "dapo-qwen2.5-32b", "--set", "trainer.fsdp.cpu_offload=false", "--set",
         "resources.trainer_world_size=8", "--nodes", "1", "--gpus-per-node", "8", "--json"],
    )  # fmt: skip
    assert bad.exit_code == 1, bad.output
    data = json.loads(bad.stdout)
    assert data["fits"] is False and any("cpu_offload" in p for p in data["problems"])
    disk = runner.invoke(app, ["plan", "--recipe", "dapo-qwen2.5-math-1.5b", "--disk", "50"])
    assert disk.exit_code == 1 and "trainer.max_ckpt_to_keep=" in disk.stdout


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_plans(recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no built base model here: tiny recipes plan from model.tiny
    result = runner.invoke(app, ["plan", "--recipe", recipe])
    assert result.exit_code == 0, result.output
    cfg = load_config(recipe=recipe, env={})
    assert (NO_GPU_LIMITS in result.stdout) == (cfg.resources.n_gpus_per_node == 0)


def test_unknown_model_names_model_path_and_the_flag(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["plan", "--recipe", "dapo-qwen2.5-32b", "--set", "model.path=org/unknown-model"])
    assert result.exit_code == 2 and "model.path" in result.stderr and "--model-config" in result.stderr


def test_train_preflight_stops_a_plan_that_cannot_fit(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("DAPO_PLAN_GPU_MEM_GB", "24")  # the GPU memory the check assumes without a local GPU
    result = runner.invoke(app, ["train", "--recipe", "dapo-qwen2.5-math-1.5b"])
    assert result.exit_code == 1, result.output
    assert "cannot fit" in result.stderr and "--skip-plan" in result.stderr
    assert "trainer.micro_batch_size=" in result.stderr or "cpu_offload" in result.stderr
