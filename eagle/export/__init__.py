"""Export trained heads for vLLM / SGLang / speculators / llama.cpp / the Hub, validate folders, load them back."""

from eagle.export.exporter import export_head, resolve_head_source, run_export, write_export
from eagle.export.loader import load_draft, load_exported_head
from eagle.export.registry import FORMATS
from eagle.export.validate import ExportedHead, check_folder, read_folder

__all__ = [
    "FORMATS",
    "ExportedHead",
    "check_folder",
    "export_head",
    "load_draft",
    "load_exported_head",
    "read_folder",
    "resolve_head_source",
    "run_export",
    "write_export",
]
