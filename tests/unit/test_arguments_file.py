"""``training_args.json`` is written whole or not at all (one_loop._write_arguments): a checkpoint's
``_save`` writes it on the save's writer thread while ``_save_checkpoint`` may write it on the training
thread, and two writers of one open file once left a checkpoint's file with the tail of the longer text
after the shorter one (JSON "Extra data", seen under load in CI)."""

from __future__ import annotations

import json
import os
import threading

import transformers

from raytrainer.one_loop import _write_arguments


def test_two_writers_leave_one_whole_arguments_file_and_nothing_else(tmp_path):
    short = transformers.TrainingArguments(str(tmp_path / "a"), report_to=[])
    long = transformers.TrainingArguments(str(tmp_path / ("b" * 400)), report_to=[], run_name="x" * 400)
    assert len(long.to_json_string()) > len(short.to_json_string()) + 700
    seen = []

    def write(args):
        for _ in range(200):
            _write_arguments(str(tmp_path), args)

    def read():
        for _ in range(400):
            with open(tmp_path / "training_args.json") as f:
                seen.append(json.load(f)["output_dir"])  # never a torn file

    _write_arguments(str(tmp_path), short)
    threads = [threading.Thread(target=write, args=(a,)) for a in (short, long)]
    threads.append(threading.Thread(target=read))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with open(tmp_path / "training_args.json") as f:
        assert json.load(f)["output_dir"] in (short.output_dir, long.output_dir)
    assert set(seen) <= {short.output_dir, long.output_dir} and len(seen) == 400
    assert sorted(os.listdir(tmp_path)) == ["training_args.json"]  # no temporary file left
