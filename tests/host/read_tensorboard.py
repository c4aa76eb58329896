"""Decodes a TensorBoard event file with python3-protobuf against the protos Tessera vendors
(compiled here with protoc), checks the TFRecord framing (masked CRC-32C) and prints what it
holds as JSON: {"scalars": {tag: {step: value}}, "hparams": {...}, "status": int}."""
import glob
import json
import os
import struct
import subprocess
import sys
import tempfile

proto_root, event_dir = sys.argv[1], sys.argv[2]
out = tempfile.mkdtemp()
protos = glob.glob(os.path.join(proto_root, "tensorboard", "**", "*.proto"), recursive=True)
subprocess.run(["protoc", "-I", proto_root, "-I", "/usr/include", "--python_out", out] + protos, check=True)
sys.path.insert(0, out)
from tensorboard.compat.proto import event_pb2  # noqa: E402
from tensorboard.plugins.hparams import plugin_data_pb2  # noqa: E402


def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def masked(data):
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


files = glob.glob(os.path.join(event_dir, "events.out.tfevents.*"))
assert len(files) == 1, files
scalars, hparams, status, first = {}, {}, None, None
with open(files[0], "rb") as f:
    data = f.read()
pos = 0
while pos < len(data):
    header = data[pos:pos + 8]
    (length,) = struct.unpack("<Q", header)
    assert struct.unpack("<I", data[pos + 8:pos + 12])[0] == masked(header), "bad length CRC"
    body = data[pos + 12:pos + 12 + length]
    assert struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])[0] == masked(body), "bad data CRC"
    pos += 16 + length
    event = event_pb2.Event()
    event.ParseFromString(body)
    if first is None:
        first = event.file_version
    for value in event.summary.value:
        if value.metadata.plugin_data.plugin_name == "hparams":
            plugin = plugin_data_pb2.HParamsPluginData()
            plugin.ParseFromString(value.metadata.plugin_data.content)
            if plugin.HasField("session_start_info"):
                for name, v in plugin.session_start_info.hparams.items():
                    hparams[name] = getattr(v, v.WhichOneof("kind"))
            if plugin.HasField("session_end_info"):
                status = plugin.session_end_info.status
        elif value.WhichOneof("value") == "simple_value":
            scalars.setdefault(value.tag, {})[event.step] = value.simple_value
assert first == "brain.Event:2", first
print(json.dumps({"scalars": scalars, "hparams": hparams, "status": status}))
