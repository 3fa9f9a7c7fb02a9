"""Regenerate ``deploy/k8s/schemas/keda-scaledobject-v1alpha1.json``: KEDA's ScaledObject CRD as a JSON schema.

The schema comes from the PyPI wheel ``cloudcoil-models-keda`` (pydantic models generated from KEDA's
CRDs). That wheel requires Python >= 3.14 and a matching ``cloudcoil`` runtime, so it is never installed
here: the script downloads the wheel (``pip download --no-deps --python-version 3.14``), puts a minimal
stand-in for the few ``cloudcoil`` base classes the generated module imports in ``sys.modules``, loads
``v1alpha1.py`` with postponed annotations, and writes ``ScaledObject.model_json_schema(by_alias=True)``.

Strictness: objects are closed (``additionalProperties: false``) unless the CRD marks them
``x-kubernetes-preserve-unknown-fields`` (the generated model then says ``extra="allow"``), so a
misspelt field fails validation. Usage::

    python -m tools.keda_schema                      # download the pinned version, write the schema
    python -m tools.keda_schema --wheel path/to.whl  # use a wheel already on disk
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path
from typing import Any, Generic, TypeVar

import pydantic

__all__ = ["KEDA_MODELS_VERSION", "SCHEMA_PATH", "main", "scaledobject_schema"]

KEDA_MODELS_VERSION = "2.20.2.1"
SCHEMA_PATH = Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "schemas" / "keda-scaledobject-v1alpha1.json"
_MODULE = "cloudcoil/models/keda/v1alpha1.py"

_B = TypeVar("_B")
_M = TypeVar("_M")


class _Anything:
    """Stands in for the generated builders' helpers; only their class statements must evaluate."""

    def __class_getitem__(cls, _item: Any) -> type[_Anything]:
        return cls


class _BuilderContextBase(Generic[_B]):
    """Generic base of the generated ``BuilderContext`` classes (never instantiated here)."""


class _GenericListBuilder(Generic[_M, _B]):
    """Generic list builder referenced in return annotations (never instantiated here)."""


class _BaseModel(pydantic.BaseModel):
    """cloudcoil's model base: fields by alias, unknown fields refused unless a model allows them."""

    model_config = pydantic.ConfigDict(extra="forbid", populate_by_name=True)


class _ObjectMeta(_BaseModel):
    """Kubernetes ObjectMeta, loose as in the CRD (``metadata: {type: object}``)."""

    model_config = pydantic.ConfigDict(extra="allow", title="ObjectMeta")
    name: str | None = None
    namespace: str | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None

    class Builder(_Anything):
        """Referenced by the generated ``metadata`` builder methods."""

    class BuilderContext(_Anything):
        """Referenced by the generated ``metadata`` builder methods."""


def _install_cloudcoil_stand_in() -> None:
    pyd = types.ModuleType("cloudcoil.pydantic")
    for name, value in {"UNSET": object(), "BaseBuilder": _Anything, "BaseModel": _BaseModel,
                        "BaseModelBuilder": _Anything, "BuilderContextBase": _BuilderContextBase,
                        "GenericListBuilder": _GenericListBuilder, "ListBuilderContext": _Anything,
                        "Never": Any, "Self": Any}.items():
        setattr(pyd, name, value)
    machinery = types.ModuleType("cloudcoil.apimachinery")
    machinery.ObjectMeta = _ObjectMeta  # type: ignore[attr-defined]
    resources = types.ModuleType("cloudcoil.resources")
    resources.Resource = _BaseModel  # type: ignore[attr-defined]
    root = types.ModuleType("cloudcoil")
    sys.modules.update({"cloudcoil": root, "cloudcoil.pydantic": pyd, "cloudcoil.apimachinery": machinery,
                        "cloudcoil.resources": resources})


def scaledobject_schema(wheel: Path) -> dict[str, Any]:
    """The ScaledObject JSON schema from the generated model inside ``wheel`` (a cloudcoil-models-keda wheel)."""
    with zipfile.ZipFile(wheel) as archive:
        source = archive.read(_MODULE).decode()
    _install_cloudcoil_stand_in()
    module = types.ModuleType("keda_v1alpha1")
    sys.modules[module.__name__] = module  # pydantic looks generic models' modules up by name
    # Postponed annotations: the generated file relies on Python 3.14's lazy annotations for forward references.
    exec(compile("from __future__ import annotations\n" + source, _MODULE, "exec"), module.__dict__)
    namespace = {k: v for k, v in module.__dict__.items() if isinstance(v, type)}
    scaled_object: type[pydantic.BaseModel] = module.__dict__["ScaledObject"]
    scaled_object.model_rebuild(_types_namespace=namespace)
    schema = scaled_object.model_json_schema(by_alias=True, mode="validation")
    schema["$comment"] = ("KEDA ScaledObject (keda.sh/v1alpha1) from the PyPI wheel "
                          f"cloudcoil-models-keda=={wheel_version(wheel)}; regenerate with python -m tools.keda_schema")
    return schema


def wheel_version(wheel: Path) -> str:
    """The version part of a wheel's file name (``name-VERSION-py3-none-any.whl``)."""
    return wheel.name.split("-")[1]


def _download(version: str, into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.14", "-d", str(into), f"cloudcoil-models-keda=={version}"], check=True)
    return next(into.glob("cloudcoil_models_keda-*.whl"))


def main(argv: list[str] | None = None) -> int:
    """Write the schema file; print its path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, help="a cloudcoil-models-keda wheel (default: download the pinned one)")
    parser.add_argument("--version", default=KEDA_MODELS_VERSION, help="the wheel version to download")
    parser.add_argument("--out", type=Path, default=SCHEMA_PATH, help="where the JSON schema goes")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel or _download(args.version, Path(tmp))
        schema = scaledobject_schema(wheel)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
