"""Real weights and training prompts to the lent GPU machine, and a trained head back from it.

The device tool sends the repository with each call, 64 MiB at most together with the paths a call
carries; it returns at most 8 files of 16 MiB from $OUT. The GPU machine reaches no package
registry and has no ``gguf`` package to convert a GGUF with. SmolLM2-135M-Instruct's GGUF is 98 MB,
the training prompts 8 MB, a trained EAGLE-3 head ~38 MB in float32. So:

  here   python bench/gpu_carry.py pack
             .gpu_carry/call1 .. callN (git-ignored): the model's config.json (no weights; the
             tokenizer is read from the GGUF's metadata), the GGUF cut into parts, the prompts; each call's share fits beside the
             repository. Prints the calls to make, back to back: the machine stays warm only ~30 s
             after a call, and a fresh one has lost what the earlier calls left in /tmp.
  there  python bench/gpu_carry.py stash .gpu_carry/callK      (every call but the last: its share to $CARRY)
         LAST_CALL=.gpu_carry/callN python bench/gpu_carry.py ready
                                   (the last: its share, then $CARRY/model joined, sha256-checked)
             $CARRY/model is a model directory turbospec loads (config.json + one .gguf: turbospec
             reads the GGUF itself, its tokenizer too, dequantizing the blocks on CUDA).
  there  python bench/gpu_carry.py split-out FILE... --out $OUT (one .tar.gz in parts of <= 15 MiB)
  here   python bench/gpu_carry.py join-back DIR --dest HEAD    (the parts together, sha256-checked)

The last call then runs bench/gpu_all.sh (its `e2ereal` stage: bench_gpu.py on the real weights and
the Spec-Bench sample) and / or bench/gpu_train.sh. $CARRY defaults to /tmp/turbospec_carry.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
CALL_LIMIT = 64 * MIB          # the device tool: the working tree that travels, per call
BACK_LIMIT = 15 * MIB          # the device tool returns files of up to 16 MiB: a margin
DEFAULT_CARRY = os.environ.get("CARRY", "/tmp/turbospec_carry")
MANIFEST = "carry_manifest.json"
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def travel_size(repo: Path) -> int:
    """Bytes the device tool sends without any carry: tracked files and untracked files git does
    not ignore (what `git ls-files` lists, as it is in the working tree now)."""
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         check=True, capture_output=True).stdout
    total = 0
    for name in out.decode().split("\0"):
        p = repo / name
        if name and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def plan_calls(fixed: list[tuple[str, int]], blob_size: int, room: int, min_part: int = MIB) -> list[list]:
    """Which call carries what: the small files first (never cut), then the blob in parts that fill
    each call's room. Returns per call a list of ("file", name, size) / ("part", index, offset, size)."""
    if room < min_part:
        raise ValueError(f"no room to carry anything: {room} bytes per call beside the repository")
    calls: list[list] = [[]]
    left = room
    for name, size in fixed:
        if size > room:
            raise ValueError(f"{name} ({size} bytes) does not fit in one call ({room} bytes of room)")
        if size > left:
            calls.append([])
            left = room
        calls[-1].append(("file", name, size))
        left -= size
    offset, index = 0, 0
    while offset < blob_size:
        if left < min_part:
            calls.append([])
            left = room
        take = min(left, blob_size - offset)
        calls[-1].append(("part", index, offset, take))
        offset += take
        left -= take
        index += 1
    return calls


def cmd_pack(args) -> int:
    import turbospec
    from turbospec.model.loader import gguf_path, resolve_model_dir
    source = turbospec.default_model_path() if args.model == "default" else args.model
    gguf = gguf_path(source)
    if gguf is None:
        raise SystemExit(f"--model {args.model!r}: expected a .gguf file (or 'default')")
    gguf = Path(gguf)
    model_dir = Path(resolve_model_dir(gguf))  # config.json (and the tokenizer files of a GGUF whose tokenizer transformers converts)
    data = [Path(d) for d in args.data]
    for d in data:
        if not d.is_file():
            raise SystemExit(f"--data {str(d)!r} does not exist")
    out = Path(args.dir)
    if out.exists():
        shutil.rmtree(out)
    fixed = [(f"model/{n}", (model_dir / n).stat().st_size) for n in MODEL_FILES if (model_dir / n).is_file()]
    fixed += [(f"data/{d.name}", d.stat().st_size) for d in data]
    by_name = {f"data/{d.name}": d for d in data}
    base = travel_size(ROOT) if args.repo_bytes is None else args.repo_bytes
    room = CALL_LIMIT - base - args.margin_mib * MIB - 64 * 1024  # the manifest and folders
    calls = plan_calls(fixed, gguf.stat().st_size, room)
    manifest = {"gguf": gguf.name, "gguf_bytes": gguf.stat().st_size, "gguf_sha256": sha256(gguf),
                "parts": [], "files": {}, "calls": len(calls)}
    with open(gguf, "rb") as src:
        for k, call in enumerate(calls, 1):
            folder = out / f"call{k}"
            folder.mkdir(parents=True)
            for item in call:
                if item[0] == "file":
                    _, name, _ = item
                    from_path = by_name.get(name) or model_dir / name.split("/", 1)[1]
                    dest = folder / name
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(from_path, dest)
                    manifest["files"][name] = sha256(dest)
                else:
                    _, index, offset, size = item
                    part = f"gguf.part{index:02d}"
                    src.seek(offset)
                    (folder / part).write_bytes(src.read(size))
                    manifest["parts"].append(part)
    for k in range(1, len(calls) + 1):  # every call carries the manifest: join checks against it
        (out / f"call{k}" / MANIFEST).write_text(json.dumps(manifest, indent=1))
    sizes = [sum(p.stat().st_size for p in (out / f"call{k}").rglob("*") if p.is_file()) for k in range(1, len(calls) + 1)]
    print(f"gpu_carry: {gguf.name} ({manifest['gguf_bytes'] / MIB:.1f} MiB) + {len(fixed)} files in {len(calls)} "
          f"calls; the repository sends {base / MIB:.1f} MiB, so each call has {room / MIB:.1f} MiB of room")
    for k, s in enumerate(sizes, 1):
        last = k == len(calls)
        rel = os.path.relpath(out / f"call{k}", ROOT)
        # gpu_all's logs in one file (the device tool returns at most 8), the head's parts beside it
        cmd = (f"PACK=\"$OUT/gpu_all.tgz\" OUT=bench/out/gpu_all LAST_CALL={rel} STAGES='build test e2ereal' "
               f"bash bench/gpu_all.sh; bash bench/gpu_train.sh" if last
               else f"python bench/gpu_carry.py stash {rel}")
        print(f"  call {k}: carry [\"{rel}\"] ({(s + base) / MIB:.1f} MiB with the repository), command: {cmd}")
    return 0


def cmd_stash(args) -> int:
    src, dest = Path(args.folder), Path(args.carry)
    if not (src / MANIFEST).is_file():
        raise SystemExit(f"stash: {src} is not a folder made by `gpu_carry.py pack` (no {MANIFEST})")
    for p in sorted(src.rglob("*")):
        if p.is_file():
            target = dest / p.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, target)
    print(f"gpu_carry: stashed {src} in {dest}: {sorted(p.name for p in dest.iterdir())}")
    return 0


def cmd_join(args) -> int:
    carry = Path(args.carry)
    manifest = json.loads((carry / MANIFEST).read_text())
    missing = [p for p in manifest["parts"] if not (carry / p).is_file()]
    missing += [n for n in manifest["files"] if not (carry / n).is_file()]
    if missing:
        raise SystemExit(f"join: {carry} lacks {missing}: the machine was not kept warm between the calls "
                         f"(a fresh machine starts bare), or a call was left out; make all {manifest['calls']} again")
    for name, digest in manifest["files"].items():
        if sha256(carry / name) != digest:
            raise SystemExit(f"join: {carry / name} differs from what pack wrote (sha256)")
    model = carry / "model"
    model.mkdir(exist_ok=True)
    gguf = model / manifest["gguf"]
    with open(gguf, "wb") as out:
        for part in manifest["parts"]:
            out.write((carry / part).read_bytes())
    if gguf.stat().st_size != manifest["gguf_bytes"] or sha256(gguf) != manifest["gguf_sha256"]:
        gguf.unlink()
        raise SystemExit(f"join: the joined {manifest['gguf']} differs from the original (size or sha256)")
    for part in manifest["parts"]:
        (carry / part).unlink()
    print(f"gpu_carry: {model} ({manifest['gguf']}, sha256 ok)")
    return 0


def cmd_ready(args) -> int:
    """The last call's start: its share stashed (--last), the model joined unless it already is;
    prints the model directory."""
    if args.last:
        cmd_stash(argparse.Namespace(folder=args.last, carry=args.carry))
    model = Path(args.carry) / "model"
    if not ((model / "config.json").is_file() and list(model.glob("*.gguf"))):
        cmd_join(args)
    print(model)
    return 0


def cmd_split_out(args) -> int:
    """The files as one .tar.gz, cut into parts of at most --part-bytes, and an index: few files
    (the device tool returns at most 8) under the size limit."""
    import io
    import tarfile
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for f in map(Path, args.files):
            tar.add(f, arcname=f.name)
    data = buf.getvalue()
    parts = [f"bundle.tar.gz.part{i:02d}" for i in range(max(1, -(-len(data) // args.part_bytes)))]
    for i, name in enumerate(parts):
        (out / name).write_bytes(data[i * args.part_bytes:(i + 1) * args.part_bytes])
    index = {"files": [Path(f).name for f in args.files], "parts": parts, "bytes": len(data),
             "sha256": hashlib.sha256(data).hexdigest()}
    (out / "split_index.json").write_text(json.dumps(index, indent=1))
    print(f"gpu_carry: {len(args.files)} files, {len(data) / MIB:.1f} MiB compressed, in {len(parts)} parts under {out}")
    return 0


def cmd_join_back(args) -> int:
    import io
    import tarfile
    src, dest = Path(args.folder), Path(args.dest)
    index = json.loads((src / "split_index.json").read_text())
    missing = [p for p in index["parts"] if not (src / p).is_file()]
    if missing:
        raise SystemExit(f"join-back: {src} lacks {missing}")
    data = b"".join((src / p).read_bytes() for p in index["parts"])
    if len(data) != index["bytes"] or hashlib.sha256(data).hexdigest() != index["sha256"]:
        raise SystemExit("join-back: the joined bundle differs from what split-out wrote (size or sha256)")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        names = tar.getnames()
        if sorted(names) != sorted(index["files"]) or any("/" in n or n.startswith(".") for n in names):
            raise SystemExit(f"join-back: the bundle holds {names}, the index names {index['files']}")
        tar.extractall(dest, filter="data")
    print(f"gpu_carry: {sorted(names)} in {dest}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", help="here: the calls' shares under .gpu_carry/")
    a.add_argument("--model", default="default", help="a .gguf, or 'default' (SmolLM2-135M-Instruct)")
    shared = ROOT.parent / "shared" / "data"
    a.add_argument("--data", nargs="*", default=[str(shared / "train_prompts.jsonl"), str(shared / "specbench_dev.jsonl")],
                   help="data files to carry (default: the training prompts and the Spec-Bench sample; none: --data)")
    a.add_argument("--dir", default=str(ROOT / ".gpu_carry"))
    a.add_argument("--margin-mib", type=int, default=2, help="room kept free in each call")
    a.add_argument("--repo-bytes", type=int, default=None, help=argparse.SUPPRESS)  # tests
    a = sub.add_parser("stash", help="there: a call's share into $CARRY")
    a.add_argument("folder")
    a.add_argument("--carry", default=DEFAULT_CARRY)
    a = sub.add_parser("join", help="there: $CARRY/model from the stashed parts")
    a.add_argument("--carry", default=DEFAULT_CARRY)
    a = sub.add_parser("ready", help="there, last call: stash --last, join if not joined yet")
    a.add_argument("--last", default=os.environ.get("LAST_CALL", ""), help="this call's folder (default $LAST_CALL)")
    a.add_argument("--carry", default=DEFAULT_CARRY)
    a = sub.add_parser("split-out", help="there: files into parts that come back from $OUT")
    a.add_argument("files", nargs="+")
    a.add_argument("--out", required=True)
    a.add_argument("--part-bytes", type=int, default=BACK_LIMIT)
    a = sub.add_parser("join-back", help="here: the returned parts together again")
    a.add_argument("folder")
    a.add_argument("--dest", required=True)
    args = p.parse_args(argv)
    return {"pack": cmd_pack, "stash": cmd_stash, "join": cmd_join, "ready": cmd_ready, "split-out": cmd_split_out,
            "join-back": cmd_join_back}[args.cmd](args)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
