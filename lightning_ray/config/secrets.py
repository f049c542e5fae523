"""What a run's records (config.yaml, Hydra's) must not hold: secrets, masked wherever they appear."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

# A secret's key (serve.api_key, an env var's name: OPENAI_API_KEY, HF_TOKEN, ...) or a value shaped like a token
SECRET_KEY = re.compile(r"key|token|secret|passw", re.IGNORECASE)
# (not a part of a path or a name: /data/hf_downloads/ is no token; https://ghp_...@github.com is one)
SECRET_VALUE = re.compile(r"(?<![\w.-])(?<!\w/)(sk-|hf_|ghp_|gho_|github_pat_|xox[abp]-|AKIA)[\w-]{8,}")
URL_PASSWORD = re.compile(r"(?<=://)([^/\s:@]+):[^/\s@]+(?=@)")  # https://user:password@host: the password
ENV_REF = r"\$\{oc\.env:\w+\}"  # where a secret comes from ('serve.api_key=${oc.env:MY_KEY}'), not the secret: kept
# An override that sets a secret, as Hydra's records of a command line hold it: alone, or one of a k=v,k=v list
# (override_dirname); its value runs to the next override
_NEXT = r"(?=,[+~]*[\w.@/-]+=|$)"
SECRET_OVERRIDE = re.compile(  # (not a key ending in _env: the name of the variable holding one)
    rf"((?:^|,)[+~]*[\w.@/-]*(?:{SECRET_KEY.pattern})[\w.@/-]*(?<!_env)=)(?!{ENV_REF}{_NEXT}).+?{_NEXT}",
    re.IGNORECASE)


def masked(node: Any) -> Any:
    """node with every secret-looking string, or part of a string, replaced by '***'."""
    if isinstance(node, dict):
        return {k: "***" if isinstance(v, str) and v and SECRET_KEY.search(str(k)) and not re.fullmatch(ENV_REF, v)
                and not str(k).endswith("_env")  # the name of the variable holding one (teacher.api_key_env)
                else masked(v) for k, v in node.items()}
    if isinstance(node, list):
        return [masked(v) for v in node]
    if not isinstance(node, str):
        return node
    return SECRET_OVERRIDE.sub(r"\1***", URL_PASSWORD.sub(r"\1:***", SECRET_VALUE.sub("***", node)))


def mask_file(path: Path) -> None:
    """A YAML record (Hydra's multirun.yaml, .hydra/*.yaml) rewritten with its secrets masked."""
    text = path.read_text()
    if (clean := yaml.safe_dump(masked(yaml.safe_load(text)), sort_keys=False)) != text:
        path.write_text(clean)
