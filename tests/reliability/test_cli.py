"""Issue 13, the command line: no traceback reaches a user for an input or environment problem.

One class per failure case. Each asserts the message names the problem and the fix (or the correct
behaviour): ``kernelmix`` prints a KernelmixError, an OS error (path, errno, fix), a missing optional
package or Ctrl-C as one line, ``--debug`` / ``KERNELMIX_DEBUG=1`` re-raise, bugs keep their
traceback; ``kernelmix convert`` never says "saved to" without having saved, refuses a pickle, and
saves all or nothing under the run-directory lock. Tiny models built offline, as tests/test_convert.py.
"""

from __future__ import annotations

import argparse
import errno
import json
import signal
import subprocess
import sys

import pytest
import torch

from kernelmix.cli import main
from kernelmix.errors import Interrupted, KernelmixError

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from kernelmix import pretrained  # noqa: E402

CONVERT = ["--mixer", "performer", "--num-features", "8"]


def tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """A tiny Llama saved with save_pretrained (safetensors), read-only for the tests."""
    path = tmp_path_factory.mktemp("host") / "tiny-llama"
    tiny_llama().save_pretrained(str(path))
    return path


def _never(*args, **kwargs):
    raise AssertionError("the command went on to its work although its input was refused")


def _files(path):
    return sorted(p.name for p in path.iterdir()) if path.is_dir() else []


# ---------------------------------------------------------------------------------------------
# The top-level handler


def _command_raising(monkeypatch, error):
    """``kernelmix model-info tiny`` that raises ``error`` where its work would be."""
    from kernelmix.cli import model_info

    def fail(args):
        raise error

    monkeypatch.setattr(model_info, "_model_info", fail)


class TestKernelmixErrorIsOneLine:
    def test_message_alone_on_stderr_with_the_exit_code(self, monkeypatch, capsys):
        _command_raising(monkeypatch, KernelmixError("the corpus 'x' is empty: add text files to it"))
        assert main(["model-info", "tiny"]) == 1
        err = capsys.readouterr().err
        assert err == "kernelmix model-info: error: the corpus 'x' is empty: add text files to it\n"

    def test_a_field_error_of_the_library_is_one_too(self, monkeypatch, capsys):
        from kernelmix.model import ModelConfig

        def build(args):
            ModelConfig(num_layers=0)

        from kernelmix.cli import model_info
        monkeypatch.setattr(model_info, "_model_info", build)
        assert main(["model-info", "tiny"]) == 1
        assert "num_layers must be a positive integer, got 0" in capsys.readouterr().err


class TestInterruptedExitsWithTheSignal:
    @pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM])
    def test_exit_code_is_128_plus_the_signal(self, number, monkeypatch, capsys):
        _command_raising(monkeypatch, Interrupted("stopped at step 7; resume with --resume", int(number)))
        assert main(["model-info", "tiny"]) == 128 + int(number)
        err = capsys.readouterr().err
        assert "stopped at step 7; resume with --resume" in err and "Traceback" not in err


class TestCtrlC:
    def test_one_line_and_exit_130(self, monkeypatch, capsys):
        _command_raising(monkeypatch, KeyboardInterrupt())
        assert main(["model-info", "tiny"]) == 130
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "interrupted" in err


class TestOSErrorsNamePathReasonAndFix:
    @pytest.mark.parametrize("error, reason, fix", [
        (OSError(errno.ENOSPC, "No space left on device", "/data/out/model.safetensors"),
         "No space left on device (ENOSPC)", "free some space on that disk or write somewhere else (another --out)"),
        (PermissionError(errno.EACCES, "Permission denied", "/data/out"), "Permission denied (EACCES)",
         "check its permissions"),
        (FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/corpus.txt"),
         "No such file or directory (ENOENT)", "it does not exist"),
    ])
    def test_environment_errors(self, error, reason, fix, monkeypatch, capsys):
        _command_raising(monkeypatch, error)
        assert main(["model-info", "tiny"]) == 1
        err = capsys.readouterr().err
        assert f"{error.filename}: {reason}" in err and fix in err and "Traceback" not in err

    def test_safetensors_error_around_a_full_disk(self, monkeypatch, capsys):
        error = safetensors.SafetensorError(
            'Error while serializing: I/O error: No space left on device (os error 28) at path "/data/out/.tmpX"')
        _command_raising(monkeypatch, error)
        assert main(["model-info", "tiny"]) == 1
        err = capsys.readouterr().err
        assert "/data/out/.tmpX: No space left on device (ENOSPC)" in err and "free some space" in err


class TestMissingOptionalPackageNamesTheExtra:
    def test_module_not_found_of_an_optional_dependency(self, monkeypatch, capsys):
        _command_raising(monkeypatch, ModuleNotFoundError("No module named 'yaml'", name="yaml"))
        assert main(["model-info", "tiny"]) == 1
        assert 'pip install "kernelmix[train]"' in capsys.readouterr().err

    def test_require_names_the_pretrained_extra(self, monkeypatch, capsys):
        def need(args):
            pretrained.require("no_such_package_kernelmix_test")

        from kernelmix.cli import model_info
        monkeypatch.setattr(model_info, "_model_info", need)
        assert main(["model-info", "tiny"]) == 1
        assert 'no_such_package_kernelmix_test' in (err := capsys.readouterr().err) and "kernelmix[pretrained]" in err


class TestDebugShowsTheTraceback:
    @pytest.mark.parametrize("argv", [["--debug", "model-info", "tiny"], ["model-info", "tiny", "--debug"]])
    def test_debug_flag_before_or_after_the_subcommand(self, argv, monkeypatch, capsys):
        _command_raising(monkeypatch, KernelmixError("bad input: fix it"))
        assert main(["model-info", "tiny"]) == 1  # without it: the message alone
        with pytest.raises(KernelmixError, match="bad input: fix it"):
            main(argv)

    def test_environment_variable(self, monkeypatch, capsys):
        _command_raising(monkeypatch, OSError(errno.ENOSPC, "No space left on device", "/x"))
        assert main(["model-info", "tiny"]) == 1
        monkeypatch.setenv("KERNELMIX_DEBUG", "1")
        with pytest.raises(OSError):
            main(["model-info", "tiny"])


class TestBugsKeepTheirTraceback:
    @pytest.mark.parametrize("bug", [RuntimeError("a bug"), TypeError("a bug"),
                                     ModuleNotFoundError("No module named 'kernelmix.nothing'",
                                                         name="kernelmix.nothing")])
    def test_other_exceptions_propagate(self, bug, monkeypatch, capsys):
        _command_raising(monkeypatch, KernelmixError("a user error"))
        assert main(["model-info", "tiny"]) == 1  # a user error is a message ...
        _command_raising(monkeypatch, bug)
        with pytest.raises(type(bug)):  # ... a bug is not hidden behind one
            main(["model-info", "tiny"])


# ---------------------------------------------------------------------------------------------
# --set and config files


class TestSetListForAOneNameField:
    def test_list_for_mixer_names_field_value_and_forms(self, tmp_path, capsys):
        with pytest.raises(SystemExit) as stop:
            main(["train", "--set", "preset=tiny", "--set", 'model.mixer=["cubit"]', "--out", str(tmp_path / "run")])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert "mixer must be one of: softmax, cubit" in err and "(one value, not a list)" in err and "['cubit']" in err
        assert not (tmp_path / "run").exists()

    def test_mapping_for_a_choice_in_a_config_file(self, tmp_path, capsys):
        toml = tmp_path / "run.toml"
        toml.write_text('preset = "tiny"\ndevice = { kind = "cpu" }\n')
        with pytest.raises(SystemExit):
            main(["train", "--config", str(toml), "--out", str(tmp_path / "run")])
        err = capsys.readouterr().err
        assert "device must be one of: auto, cpu, cuda (one value, not a mapping), got {'kind': 'cpu'}" in err

    def test_list_items_of_the_wrong_type_list_the_names(self, tmp_path, capsys):
        with pytest.raises(SystemExit):
            main(["train", "--set", "preset=tiny", "--set", "model.mixers=[1, 2]", "--out", str(tmp_path / "run")])
        assert "mixers must be a list of names from: softmax, cubit" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# kernelmix convert: --out


class TestConvertOutIsAFile:
    def test_refused_before_loading(self, host, tmp_path, monkeypatch, capsys):
        monkeypatch.setattr("kernelmix.pretrained.load_pretrained", _never)
        target = tmp_path / "existing_file"
        target.write_text("mine")
        assert main(["convert", str(host), "--out", str(target), *CONVERT]) == 1
        captured = capsys.readouterr()
        assert "is a file" in captured.err and "choose a directory" in captured.err
        assert "saved to" not in captured.out and target.read_text() == "mine"

    def test_library_save_never_pretends(self, host, tmp_path):
        model = pretrained.convert(tiny_llama(), pretrained.ConversionConfig(mixer="performer", num_features=8))
        target = tmp_path / "existing_file"
        target.write_text("mine")
        with pytest.raises(KernelmixError, match="is a file, not a directory: choose a directory"):
            pretrained.save_converted(model, target)

    def test_a_file_on_the_way(self, host, tmp_path, monkeypatch, capsys):
        monkeypatch.setattr("kernelmix.pretrained.load_pretrained", _never)
        (tmp_path / "afile").write_text("x")
        assert main(["convert", str(host), "--out", str(tmp_path / "afile" / "sub"), *CONVERT]) == 1
        assert "afile is a file, not a directory: fix the path" in capsys.readouterr().err


class TestConvertOutNotEmpty:
    def test_refused_unless_overwrite(self, host, tmp_path, capsys):
        out = tmp_path / "notes"
        out.mkdir()
        (out / "notes.txt").write_text("keep me")
        assert main(["convert", str(host), "--out", str(out), *CONVERT]) == 1
        captured = capsys.readouterr()
        assert "is not empty (notes.txt)" in captured.err and "--overwrite" in captured.err
        assert _files(out) == ["notes.txt"] and "saved to" not in captured.out
        assert main(["convert", str(host), "--out", str(out), *CONVERT, "--overwrite"]) == 0
        assert (out / "notes.txt").read_text() == "keep me"  # only the model files are written
        assert list(pretrained.kernels(pretrained.load_converted(out))) == [0, 1]

    def test_the_model_itself_is_never_the_output(self, host, capsys):
        before = {p.name: p.read_bytes() for p in host.iterdir()}
        assert main(["convert", str(host), "--out", str(host), *CONVERT, "--overwrite"]) == 1
        assert "is the model being converted: choose another directory" in capsys.readouterr().err
        assert {p.name: p.read_bytes() for p in host.iterdir()} == before


class TestConvertDiskFull:
    @staticmethod
    def _full_disk(monkeypatch, error):
        """safetensors writing half a file, then the disk is full."""
        import transformers.modeling_utils as modeling_utils

        def write(tensors, filename, metadata=None):
            with open(filename, "wb") as f:
                f.write(b"\0" * 100)
            raise error

        monkeypatch.setattr(modeling_utils, "safe_save_file", write)

    def test_cli_names_the_path_and_the_fix_and_leaves_no_model(self, host, tmp_path, monkeypatch, capsys):
        self._full_disk(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
        out = tmp_path / "conv"
        assert main(["convert", str(host), "--out", str(out), *CONVERT]) == 1
        captured = capsys.readouterr()
        assert f"could not save the converted model to {out}" in captured.err
        assert "No space left on device (ENOSPC)" in captured.err and "free some space" in captured.err
        assert "Traceback" not in captured.err and "saved to" not in captured.out
        assert not out.exists()  # no config.json, no half file, no staging folder: the directory it created is gone

    def test_safetensors_error_type_too(self, host, tmp_path, monkeypatch):
        self._full_disk(monkeypatch, safetensors.SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"))
        model = pretrained.convert(tiny_llama(), pretrained.ConversionConfig(mixer="performer", num_features=8))
        with pytest.raises(KernelmixError, match=r"No space left on device \(ENOSPC\).*free some space"):
            pretrained.save_converted(model, tmp_path / "conv")
        assert not (tmp_path / "conv").exists()

    def test_a_failed_overwrite_keeps_the_previous_model(self, host, tmp_path, monkeypatch):
        out = tmp_path / "conv"
        assert main(["convert", str(host), "--out", str(out), *CONVERT]) == 0
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        self._full_disk(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
        assert main(["convert", str(host), "--out", str(out), "--mixer", "darkformer", "--num-features", "4",
                     "--overwrite"]) == 1
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
        monkeypatch.undo()
        assert pretrained.kernels(pretrained.load_converted(out))[0].mixer == "performer"


class TestConvertHoldsTheRunDirectoryLock:
    def test_a_second_writer_is_refused_naming_the_holder(self, host, tmp_path, capsys):
        out = tmp_path / "conv"
        holder = subprocess.Popen(
            [sys.executable, "-c", "import sys, time\nfrom kernelmix.locks import run_directory_lock\n"
             "with run_directory_lock(sys.argv[1], 'kernelmix convert (the other one)'):\n"
             "    print('held', flush=True)\n    time.sleep(60)\n", str(out)],
            stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "held"
            assert main(["convert", str(host), "--out", str(out), *CONVERT]) == 1
        finally:
            holder.kill()
            holder.wait()
        captured = capsys.readouterr()
        assert "is being written by `kernelmix convert (the other one)`" in captured.err and "--out" in captured.err
        assert "saved to" not in captured.out and "config.json" not in _files(out)


# ---------------------------------------------------------------------------------------------
# kernelmix convert / diagnose: the model argument


class TestPickledWeightsRefused:
    def test_bin_checkpoint_is_a_clear_error(self, host, tmp_path, capsys):
        from safetensors.torch import load_file

        folder = tmp_path / "pickled"
        folder.mkdir()
        (folder / "config.json").write_text((host / "config.json").read_text())
        torch.save(load_file(str(host / "model.safetensors")), folder / "pytorch_model.bin")
        assert main(["convert", str(folder), "--out", str(tmp_path / "conv"), *CONVERT]) == 1
        err = capsys.readouterr().err
        assert "pickled weights (pytorch_model.bin)" in err and "execute any code" in err
        assert "save_pretrained(OUT, safe_serialization=True)" in err
        assert not (tmp_path / "conv").exists()
        with pytest.raises(KernelmixError, match="pickled weights"):
            pretrained.load_pretrained(folder)


class TestModelArgumentIsAFile:
    @pytest.mark.parametrize("command", ["convert", "diagnose"])
    def test_config_json_given_instead_of_its_folder(self, command, host, tmp_path, capsys):
        assert main([command, str(host / "config.json"), "--out", str(tmp_path / "out")]) == 1
        err = capsys.readouterr().err
        assert "is a file, not a model directory" in err and f"its folder, {host}" in err


class TestDamagedModelDirectory:
    def _copy(self, host, tmp_path):
        folder = tmp_path / "copy"
        folder.mkdir()
        for p in host.iterdir():
            (folder / p.name).write_bytes(p.read_bytes())
        return folder

    def test_config_json_that_is_not_an_object(self, host, tmp_path, capsys):
        folder = self._copy(host, tmp_path)
        (folder / "config.json").write_text("[1, 2]")
        assert main(["convert", str(folder), "--out", str(tmp_path / "out")]) == 1
        assert "must hold a JSON object of settings, got list" in capsys.readouterr().err

    @pytest.mark.parametrize("record, message", [
        ("performer", "must be a mapping of conversion settings"),
        ({"mixer": "performer", "colour": "blue"}, r"unknown setting\(s\) \['colour'\]"),
        ({"mixer": "nope"}, "unknown mixer 'nope'"),
    ])
    def test_a_damaged_conversion_record(self, record, message, host, tmp_path):
        folder = self._copy(host, tmp_path)
        config = json.loads((folder / "config.json").read_text())
        config["kernelmix_conversion"] = record
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(KernelmixError, match=rf"config.json \(kernelmix_conversion\).*{message}"):
            pretrained.load_converted(folder)

    def test_truncated_weights(self, host, tmp_path, capsys):
        folder = self._copy(host, tmp_path)
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
        assert main(["convert", str(folder), "--out", str(tmp_path / "out"), *CONVERT]) == 1
        err = capsys.readouterr().err
        assert f"the weights in {folder} cannot be read" in err and "damaged or incomplete" in err


# ---------------------------------------------------------------------------------------------
# Outputs checked before the work


class TestOutputPathsCheckedBeforeTheWork:
    @pytest.mark.parametrize("argv, patch, message", [
        (["bench", "--lengths", "16", "--out", "{file}"], "kernelmix.studies.bench.run_bench",
         "--out {file} is a file"),
        (["demo", "--length", "16", "--json", "{dir}"], "kernelmix.studies.demo.run_demo",
         "--json {dir} is a directory"),
        (["generate-bench", "--preset", "tiny", "--json", "{dir}"],
         "kernelmix.studies.generate_bench.benchmark_generation", "--json {dir} is a directory"),
        (["diagnose", "{host}", "--out", "{file}"], "kernelmix.pretrained.load_pretrained", "--out {file} is a file"),
        (["pretrained", "prepare", "gemma3-270m", "--cache", "{file}"], "kernelmix.pretrained.prepare",
         "--cache {file} is a file"),
    ])
    def test_refused_naming_the_option(self, argv, patch, message, host, tmp_path, monkeypatch, capsys):
        places = {"file": tmp_path / "afile", "dir": tmp_path / "adir", "host": host}
        places["file"].write_text("x")
        places["dir"].mkdir()
        monkeypatch.setattr(patch, _never)
        assert main([a.format(**places) for a in argv]) == 1
        assert message.format(**places) in capsys.readouterr().err

    def test_a_folder_that_cannot_be_written(self, tmp_path, monkeypatch, capsys):
        monkeypatch.setattr("kernelmix.studies.bench.run_bench", _never)
        monkeypatch.setattr("os.access", lambda path, mode: False)  # as if another user owned tmp_path
        assert main(["bench", "--lengths", "16", "--out", str(tmp_path / "new" / "bench")]) == 1
        err = capsys.readouterr().err
        assert f"{tmp_path} is not writable by you: check its permissions" in err


# ---------------------------------------------------------------------------------------------
# List options: one rule for a repeated item


class TestRepeatedItemsInListOptions:
    """Issue 25: a repeated item was run twice (eval), dropped in silence (compare's lengths; its
    seeds reported one run as two, "± 0.000") or refused (recall). Now every list option refuses it,
    naming the option, the repeated item and the fix, before any work."""

    @pytest.mark.parametrize("argv, message", [
        (["compare", "--seeds", "0,0"], "--seeds: [0, 0] repeats 0: list each seed once"),
        (["compare", "--lengths", "256,512,256"], "--lengths: [256, 512, 256] repeats 256: list each length once"),
        (["compare", "--mixers", "softmax,cubit,softmax"],
         "--mixers: ['softmax', 'cubit', 'softmax'] repeats 'softmax'"),
        (["recall", "--pairs", "2,2", "--widths", "32"], "--pairs: [2, 2] repeats 2: list each pair count once"),
        (["eval", "{run}", "--lengths", "64,64"], "--lengths: [64, 64] repeats 64: list each length once"),
        (["eval", "{run}", "--tasks", "cloze,cloze"], "--tasks: ['cloze', 'cloze'] repeats 'cloze'"),
        (["bench", "--lengths", "16,16"], "--lengths: [16, 16] repeats 16: list each length once"),
        (["generate-bench", "--mixers", "cubit,cubit"], "--mixers: ['cubit', 'cubit'] repeats 'cubit'"),
    ])
    def test_refused_naming_the_option_the_item_and_the_fix(self, argv, message, tmp_path, monkeypatch, capsys):
        for work in ("kernelmix.studies.compare.run_compare", "kernelmix.studies.recall.run_recall",
                     "kernelmix.training.load_run", "kernelmix.studies.bench.run_bench",
                     "kernelmix.studies.generate_bench.benchmark_generation"):
            monkeypatch.setattr(work, _never)
        with pytest.raises(SystemExit) as exit_:
            main([a.format(run=tmp_path) for a in argv])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err

    def test_the_library_configs_refuse_it_too(self):
        from kernelmix.studies.compare import CompareConfig
        from kernelmix.studies.recall import RecallConfig

        with pytest.raises(KernelmixError, match=r"\[0, 1, 0, 1\] repeats 0, 1: list each seed once"):
            CompareConfig(seeds=[0, 1, 0, 1])
        with pytest.raises(KernelmixError, match="list each width once"):
            RecallConfig(widths=[32, 32])


class TestThreadsNotPositive:
    """Issue 25: ``--threads 0`` / ``--threads -2`` reached torch's ``RuntimeError: set_num_threads
    expects a positive integer`` as a traceback. Refused when the option is parsed, for every command."""

    @pytest.mark.parametrize("value", ["0", "-2"])
    @pytest.mark.parametrize("command", [["train"], ["recall"], ["compare"], ["eval", "run"], ["model-info", "tiny"],
                                         ["gpu-check", "--out", "unused"]])
    def test_refused_at_parsing_naming_the_option(self, command, value, monkeypatch, capsys):
        monkeypatch.setattr("torch.set_num_threads", _never)
        with pytest.raises(SystemExit) as exit_:
            main([*command, f"--threads={value}"])
        assert exit_.value.code == 2
        assert "argument --threads: must be a positive integer" in capsys.readouterr().err

    def test_every_command_that_takes_threads_checks_it(self):
        from kernelmix.cli.app import build_parser

        checked = []
        for action in build_parser()._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    for a in child._actions:
                        if "--threads" in a.option_strings:
                            with pytest.raises(Exception, match="positive integer"):
                                a.type("0")
                            checked.append(name)
        assert {"train", "recall", "compare", "eval", "bench", "gpu-check"} <= set(checked)

    def test_the_library_names_the_fix_too(self):
        from kernelmix.threads import set_threads

        with pytest.raises(KernelmixError, match="threads must be a positive integer"):
            set_threads(0)
