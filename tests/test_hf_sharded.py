"""Hugging Face folders read and written in shards: each rank reads only its slices of the safetensors
files and writes its own files of an export (weights/hf_read.py, hf_write.py): counted in the ranks,
each reads and writes its share of the bytes, not more. A 2-rank import takes
the 1-rank step-1 loss; the 2-rank export is fms_to_hf's conversion of the same step's checkpoint, tensor
for tensor and logit for logit in transformers, reads back bit for bit, and keeps the context of a
rope-scaled model; both ranks write the one model file at the end at once; a damaged folder ends in one
line naming the file, before any step."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fms_fsdp.errors import CheckpointError, ConfigError
from fms_fsdp.flags import parse_args
from fms_fsdp.model.variants import build_model, get_model_config
from fms_fsdp.startup import facts
from fms_fsdp.weights.hf import convert, hf_config
from fms_fsdp.weights.load import load_weights

from conftest import TINY, launch, records, run_here
from test_hf import read_hf_model

# a Llama folder with llama3 rotary scaling: factor 4 over tiny's 1024 positions, 4096 in all
SCALED = ["--rope_scaling_factor=4", "--seq_length=2048", "--vocab_size=512"]


def scaled_config():
    return get_model_config("tiny", 512, None, 1, None, 4)


def save_hf(folder: Path, shard: str = "400KB") -> Path:
    """A transformers `save_pretrained` folder of a random tiny Llama with llama3 scaling, in several files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = hf_config(scaled_config(), torch.float32, None, None)
    assert config["max_position_embeddings"] == 4096 and config["rope_scaling"]["factor"] == 4.0
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(folder, max_shard_size=shard)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One rank and two ranks, each one step from the same Hugging Face folder; the 2-rank run exports
    that step as a Hugging Face folder and checkpoints it."""
    root = tmp_path_factory.mktemp("hf_sharded")
    hf = save_hf(root / "hf")
    common = [*TINY, *SCALED, "--num_steps=1", f"--ckpt_load_path={hf}"]
    run_here([*common, "--batch_size=2", f"--ckpt_save_path={root / 'one'}"])
    proc = launch(
        "tests/io_counter.py",  # main_training.py, each rank's bytes read and written counted (see the file)
        [
            "main_training.py",
            *common,
            "--batch_size=1",
            "--export_interval=1",
            "--export_format=hf",
            "--export_model_at_end=True",
            f"--ckpt_save_path={root / 'two'}",
        ],
        2,
        extra_env={"IO_COUNTS": str(root / "io")},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"hf": hf, "one": root / "one", "two": root / "two", "log": proc.stdout, "root": root, "io": root / "io"}


def test_two_ranks_import_their_slices_with_the_loss_of_one(runs):
    assert len(list(runs["hf"].glob("*.safetensors"))) > 3  # sharded: each rank reads slices of several files
    one, two = records(runs["one"]), records(runs["two"])
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1]
    assert abs(one[0]["loss"] - two[0]["loss"]) < 1e-5, (one, two)
    assert "is beyond tiny's" not in runs["log"]  # 2048 is within 4 x 1024: no note about the context


def test_the_parallel_export_is_fms_to_hf_of_the_same_step(runs):
    """Two ranks wrote their files of the export; it equals fms_to_hf's bf16 conversion of the step's
    checkpoint tensor for tensor (so its logits in transformers are those), keeps the model's 4096
    positions, and reads back as the checkpoint's weights in bf16, bit for bit."""
    from transformers import AutoModelForCausalLM

    export = runs["two"] / "exports" / "step_1"
    files = sorted(p.name for p in export.glob("*.safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((export / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    ckpt = runs["two"] / "checkpoints" / "step_1_ckp"
    offline = convert(str(ckpt), str(runs["root"] / "offline"), dtype="bf16")
    for folder in (export, offline):
        config = json.loads((folder / "config.json").read_text())
        assert config["max_position_embeddings"] == 4096 and config["rope_scaling"]["factor"] == 4.0
    ours = {k: v for f in files for k, v in load_file(str(export / f)).items()}
    theirs = load_file(str(offline / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    tokens = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = (AutoModelForCausalLM.from_pretrained(f, local_files_only=True).eval() for f in (export, offline))
        assert torch.equal(a(tokens).logits, b(tokens).logits)
    from fms_fsdp.weights.reader import read_model

    trained = read_model(ckpt)
    back = read_hf_model(str(export), scaled_config())
    assert back.keys() == trained.keys() and all(torch.equal(back[k], trained[k].bfloat16()) for k in back)


def test_both_ranks_write_the_model_file_at_the_end_in_place(runs):
    """--export_model_at_end's one file, each rank writing its run of the tensors into it: the step's
    checkpoint, bit for bit, and nothing left beside it."""
    from fms_fsdp.weights.reader import read_model

    trained = read_model(runs["two"] / "checkpoints" / "step_1_ckp")
    got = load_file(str(runs["two"] / "model_step_1.safetensors"))
    assert got.keys() == trained.keys() and all(torch.equal(got[k], trained[k]) for k in got)
    assert not list(runs["two"].glob(".model_step_1*"))


def test_rows_of_a_two_rank_checkpoint_are_read_by_byte_ranges(runs):
    """weights/items.py: any run of rows of a tensor that 2 ranks saved in two chunks, across the
    chunk boundary too, equals DCP's own read of it, and was read from its byte range, not the item whole."""
    import torch.distributed.checkpoint as dcp

    from fms_fsdp.weights.items import ItemRows
    from fms_fsdp.weights.reader import safe_reader

    ckpt = runs["two"] / "checkpoints" / "step_1_ckp"
    metadata = safe_reader(str(ckpt)).read_metadata()
    items = ItemRows(ckpt, metadata)
    for key in ("base_model.embedding.weight", "base_model.layers.0.attn.in_proj.qkv_fused.weight", "head.weight"):
        meta = metadata.state_dict_metadata[f"model_state.{key}"]
        assert len(meta.chunks) == 2
        want = {key: torch.empty(meta.size, dtype=meta.properties.dtype)}
        dcp.load({"model_state": want}, storage_reader=safe_reader(str(ckpt)), no_dist=True)
        rows, middle = meta.size[0], meta.chunks[1].offsets[0]
        for a, b in ((0, rows), (middle - 3, middle + 5), (1, 2), (rows - 7, rows)):
            assert torch.equal(items.rows(f"model_state.{key}", a, b), want[key][a:b]), (key, a, b)
    assert items.places and None not in items.places.values()


# What each rank of the 2-rank run of `runs` may read or write beyond its share (half the files' tensor
# bytes), counted in the real ranks by tests/io_counter.py (their file openers wrapped):
# - HEADERS: safetensors headers, besides the tensors' bytes: rank 0 reads every file's (it indexes the
#   folder: 22 files, ~5 KiB in all), each writer writes its file's;
# - ITEMS: each DCP item's zip directory and pickle, read to find where its rows start (~2.7 KiB an item,
#   ~50 items a rank: ~140 KiB an export);
# - TENSOR: an export's files, and each rank's run of the model file at the end, hold whole tensors, so a
#   rank may have up to one tensor more (or less) than half: tiny's largest, ff_sub_layer.wg1_fused,
#   1408 x 256 fp32 (FSDP's shards, read from the Hugging Face folder, are exact halves of each tensor).
# A rank that read or wrote everything would be off by half the bytes: ~6 MiB (the export: ~3 MiB).
HEADERS = 64 * 2**10
ITEMS = 256 * 2**10
TENSOR = 1408 * 256 * 4


def counted(runs: dict) -> list[dict[str, dict[str, int]]]:
    """Each rank's bytes read and written, per file (tests/io_counter.py)."""
    return [json.loads((runs["io"] / f"rank{r}.json").read_text()) for r in range(2)]


def tensor_bytes(entries: dict) -> int:
    return sum(e.end - e.start for e in entries.values())


def near(got: int, share: float, slack: int) -> bool:
    return share - slack <= got <= share + slack


def test_each_rank_reads_only_its_share_of_the_files(runs):
    """Of the Hugging Face folder (hf_read.py, read_rows by byte ranges) each rank reads its half of the
    tensors' bytes, and of each export's DCP folder (items.py: the staged shards, read back to write the
    export) its half of the model's, exactly the rows of the tensors it writes: not whole files or items,
    not every rank everything."""
    from fms_fsdp.weights.hf_read import file_entries, index_folder

    export = runs["two"] / "exports" / "step_1"
    model_file = runs["two"] / "model_step_1.safetensors"
    hf_total, export_total = tensor_bytes(index_folder(runs["hf"])), tensor_bytes(index_folder(export))
    model_entries = file_entries(model_file, model_file.name)
    model_total = tensor_bytes(model_entries)
    # the two exports (--export_interval=1, --export_model_at_end), each from a DCP folder of its own
    shards = {
        "export": str(export.with_name(".step_1.shards")),
        "model": str(model_file.with_name(f".{model_file.name}.shards")),
    }
    for rank, files in enumerate(counted(runs)):
        read: dict[str, int] = {}
        for path, n in files.items():
            if n["read"]:
                read[os.path.dirname(path)] = read.get(os.path.dirname(path), 0) + n["read"]
        hf = read.pop(str(runs["hf"]))
        assert near(hf, hf_total / 2, HEADERS), f"rank {rank} read {hf:,} bytes of the folder's {hf_total:,}"
        assert sorted(read) == sorted(shards.values()), (rank, read)
        for folder, n in read.items():
            said = f"rank {rank} read {n:,} bytes of {folder}'s {model_total:,}"
            assert near(n, model_total / 2, TENSOR + ITEMS), said
        # the source rows of what it wrote (fp32 into the export's bf16), each once, and the items' directories
        mine = [export / os.path.basename(p) for p, n in files.items() if n["written"] and "/exports/" in p]
        wrote = sum(tensor_bytes(file_entries(f, f.name)) for f in mine) * model_total // export_total
        said = f"rank {rank} read {read[shards['export']]:,} bytes to write {wrote:,} of the export (in fp32)"
        assert wrote <= read[shards["export"]] <= wrote + ITEMS, said
        wrote = files[str(model_file.with_name(f".{model_file.name}.tmp"))]["written"]
        wrote -= min(e.start for e in model_entries.values()) if rank == 0 else 0  # writer 0: the header too
        said = f"rank {rank} read {read[shards['model']]:,} bytes to write {wrote:,} of the model file"
        assert wrote <= read[shards["model"]] <= wrote + ITEMS, said


def test_each_rank_writes_only_its_share_of_an_export(runs):
    """Of the Hugging Face export (hf_write.py: a file per rank) and of the model file at the end (every
    rank its run of it, in place) each rank writes half the bytes, and the two ranks together the files
    whole: the export is not gathered to rank 0."""
    from fms_fsdp.weights.hf_read import file_entries, index_folder

    export = runs["two"] / "exports" / "step_1"
    model_file = runs["two"] / "model_step_1.safetensors"
    export_total = tensor_bytes(index_folder(export))
    model_total = tensor_bytes(file_entries(model_file, model_file.name))
    ranks = counted(runs)
    exported, model = [], []
    for rank, files in enumerate(ranks):
        written = {path: n["written"] for path, n in files.items() if n["written"]}
        exported.append(sum(n for path, n in written.items() if os.path.dirname(path).endswith("/exports/.step_1.tmp")))
        model.append(written.get(str(model_file.with_name(f".{model_file.name}.tmp")), 0))
        assert sum(written.values()) == exported[-1] + model[-1], (rank, written)  # nothing else
        said = f"rank {rank} wrote {exported[-1]:,} bytes of the export's {export_total:,}"
        assert near(exported[-1], export_total / 2, TENSOR + HEADERS), said
        said = f"rank {rank} wrote {model[-1]:,} bytes of the model file's {model_total:,}"
        assert near(model[-1], model_total / 2, TENSOR + HEADERS), said
    assert sum(exported) == sum(p.stat().st_size for p in export.glob("*.safetensors"))
    assert sum(model) == model_file.stat().st_size


def test_writers_of_one_file_give_the_file_one_writer_gives(tmp_path):
    """write_file's share: 3 writers, in any order, each its run of the tensors in place, make the same
    bytes as one writer; one folder of 1 file and 2 ranks is written by both (write_part's shared)."""
    from fms_fsdp.weights.hf_write import Converter, fms_plan, write_file, write_part
    from fms_fsdp.weights.reader import Tensors

    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(7 + i, 5, generator=g) for i in range(5)} | {"b": torch.randn(3, generator=g)}
    plan = fms_plan({k: tuple(v.shape) for k, v in state.items()}, {k: v.dtype for k, v in state.items()})
    convert = Converter(Tensors({k: v.shape for k, v in state.items()}, lambda k, a, b: state[k][a:b]))
    write_file(tmp_path / "one.safetensors", plan, convert, {"format": "pt"})
    for k in (2, 0, 1):
        write_file(tmp_path / "three.safetensors", plan, convert, {"format": "pt"}, (k, 3))
    assert (tmp_path / "three.safetensors").read_bytes() == (tmp_path / "one.safetensors").read_bytes()
    (tmp_path / "folder").mkdir()
    written = [write_part(tmp_path / "folder", [plan], convert, (r, 2), shared=True) for r in (1, 0)]
    assert written == [["model.safetensors"]] * 2
    assert (tmp_path / "folder" / "model.safetensors").read_bytes() == (tmp_path / "one.safetensors").read_bytes()


def damaged(hf: Path, tmp: Path, how: str) -> Path:
    """A copy of the folder, damaged `how`."""
    folder = tmp / how
    folder.mkdir()
    for f in hf.iterdir():
        os.link(f, folder / f.name)
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    if how == "missing":
        shard.unlink()
    elif how == "truncated":
        data = shard.read_bytes()
        shard.unlink()
        shard.write_bytes(data[: len(data) // 2])
    return folder


def test_a_damaged_folder_is_one_line_naming_the_file(runs, tmp_path):
    model = build_model(scaled_config(), torch.device("cpu"))
    for how, said in (("missing", "is missing (named in model.safetensors.index.json)"), ("truncated", "is truncated")):
        folder = damaged(runs["hf"], tmp_path, how)
        shard = sorted(p.name for p in runs["hf"].glob("model-*.safetensors"))[1]
        with pytest.raises(CheckpointError) as e:
            load_weights(model, str(folder), "tiny")
        assert str(e.value).startswith(f"--ckpt_load_path: {folder / shard} {said}"), e.value
    # tensors of another FFN width under the variant's config.json
    from transformers import LlamaConfig, LlamaForCausalLM

    wider = json.loads((runs["hf"] / "config.json").read_text())
    LlamaForCausalLM(LlamaConfig(**{**wider, "intermediate_size": 768})).save_pretrained(tmp_path / "wider")
    (tmp_path / "wider" / "config.json").write_text(json.dumps(wider))
    with pytest.raises(CheckpointError) as e:
        load_weights(model, str(tmp_path / "wider"), "tiny")
    assert str(e.value) == (
        f"--ckpt_load_path: {tmp_path / 'wider'}/model.safetensors: model.layers.0.mlp.gate_proj.weight is "
        "[768, 256], which does not fit the model's base_model.layers.0.ff_sub_layer.wg1_fused.weight [1408, 256]; "
        "choose the matching --model_variant (and --vocab_size)"
    )
    # a quantized tensor: a dtype the reader does not read
    fp8 = shutil.copytree(runs["hf"], tmp_path / "fp8")
    name = "model.layers.0.mlp.up_proj.weight"
    file = json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(fp8 / file)
    save_file({**tensors, name: tensors[name].to(torch.float8_e4m3fn)}, fp8 / file, {"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        load_weights(model, str(fp8), "tiny")
    assert str(e.value).startswith(
        f"--ckpt_load_path: {fp8}/{file}: {name} is F8_E4M3, a safetensors dtype this reader does not read "
    ), e.value


def test_a_rope_mismatch_is_refused_at_start_up_naming_the_folder_once(runs):
    """--rope_scaling_factor forgotten: config.json alone decides, before the model is built."""
    with pytest.raises(ConfigError) as e:
        facts(parse_args([*TINY, "--vocab_size=512", f"--ckpt_load_path={runs['hf']}"]))
    said = str(e.value)
    assert said.startswith(f"--ckpt_load_path: {runs['hf']}: rope_theta 10000.0 and rope_scaling {{'rope_type'"), said
    assert said.count(str(runs["hf"])) == 1 and said.endswith("(or --rope_theta, --rope_scaling_factor)"), said


@pytest.mark.slow
def test_every_mesh_imports_its_slices_exactly_and_exports_them(tmp_path):
    """On 4 ranks, a rope-scaled Hugging Face folder read slice by slice into FSDP x TP, FSDP x pipeline
    stages, FSDP x context parallel, and a LoRA model's frozen base; one step at learning rate 0, then the
    model exported at the end (and, for LoRA, as a Hugging Face folder every rank writes) is the folder's
    weights, bit for bit."""
    hf = save_hf(tmp_path / "hf")
    common = [*TINY, "--rope_scaling_factor=4", "--vocab_size=512", "--num_steps=1", "--learning_rate=0"]
    common += [f"--ckpt_load_path={hf}", "--checkpoint_interval=0", "--export_model_at_end=True"]
    meshes = {
        "tp": ["--tensor_parallel_size=2"],
        "pp": ["--pipeline_parallel_size=2", "--batch_size=4"],
        "cp": ["--context_parallel_size=2"],
        "lora": ["--lora_rank=4", "--export_interval=1", "--export_format=hf"],
    }
    proc = launch(
        "tests/runs_worker.py",
        [],
        4,
        extra_env={"RUNS": json.dumps([[*common, *f, f"--ckpt_save_path={tmp_path / m}"] for m, f in meshes.items()])},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    want = read_hf_model(str(hf), scaled_config())
    for mesh in meshes:
        got = load_file(str(tmp_path / mesh / "model_step_1.safetensors"))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), mesh
    export = tmp_path / "lora" / "exports" / "step_1"
    assert len(list(export.glob("model-0000?-of-00004.safetensors"))) == 4  # one file per rank
    back = read_hf_model(str(export), scaled_config())
    assert all(torch.equal(back[k], want[k].bfloat16()) for k in want)


def test_the_note_about_the_context_counts_the_rotary_scaling():
    """tiny has 1024 positions; scaled by 2, 2048: --seq_length=4096 is beyond them, 2048 is not."""
    notes = facts(parse_args([*TINY, "--rope_scaling_factor=2", "--seq_length=4096"])).notes
    assert (
        "note: --seq_length=4096 is beyond tiny's 2048 positions (with --rope_scaling_factor=2.0): the model trains "
        "at 4096, and its Hugging Face exports say max_position_embeddings=4096" in notes
    ), notes
    assert not [
        n for n in facts(parse_args([*TINY, "--rope_scaling_factor=2", "--seq_length=2048"])).notes if "beyond" in n
    ]
