"""Edits of a saved checkpoint's safetensors header, as a hostile or careless tool would make them: the tests of
integrity checks use these to strip, swap or re-seal entries without going through save_compressed."""

import json
import struct

from jax_neuronmm.compress.checkpoint import HEADER_SHA256, header_digest


def rewrite_header(path, edit, *, reseal: bool):
    """Calls edit(header) on the file's JSON header ({tensor name: entry, "__metadata__": {...}}) and writes it back
    around the unchanged tensor data. reseal=True recomputes the metadata checksum afterwards (as a forger who knows
    the format would), so the checks behind it are the ones tested."""
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    edit(header)
    if reseal:
        header["__metadata__"][HEADER_SHA256] = header_digest(header["__metadata__"])
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors keeps the data 8-byte aligned
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + size :])


def edit_metadata(path, edit, *, reseal: bool):
    """rewrite_header, editing only the metadata dict (str -> str)."""
    rewrite_header(path, lambda header: edit(header["__metadata__"]), reseal=reseal)


def swap(mapping, a, b):
    mapping[a], mapping[b] = mapping[b], mapping[a]


def swap_json_entries(metadata, key, a, b):
    """Exchanges entries a and b of the JSON object stored under metadata[key]."""
    value = json.loads(metadata[key])
    swap(value, a, b)
    metadata[key] = json.dumps(value)
