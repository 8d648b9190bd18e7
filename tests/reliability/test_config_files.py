"""Config files and presets a user gets wrong: each refusal names the problem and the fix."""

from __future__ import annotations

import pytest

from kernelmix.errors import KernelmixError
from kernelmix.model import ModelConfig
from kernelmix.training.config import RESOLVED_FORMAT, TrainConfig, read_config_file


class TestConfigFileIsADirectory:
    def test_says_it_is_a_directory(self, tmp_path):
        with pytest.raises(KernelmixError, match=r"is a directory: pass the config file inside it"):
            read_config_file(tmp_path)


class TestConfigFileNotUtf8:
    def test_names_the_file_and_the_fix(self, tmp_path):
        path = tmp_path / "run.toml"
        path.write_bytes(b"steps = 10\n# caf\xe9\n")
        with pytest.raises(KernelmixError, match=r"run\.toml' is not UTF-8 text .*save it as UTF-8"):
            read_config_file(path)


class TestResolvedConfigWithADamagedTrainSection:
    def test_names_the_section(self):
        expected = r"resolved run config: its 'train' section must be a mapping of settings, got list"
        with pytest.raises(KernelmixError, match=expected):
            TrainConfig.from_dict({"format": RESOLVED_FORMAT, "train": [1, 2]})


class TestPresetGivenAsAList:
    def test_one_name_not_a_list(self):
        with pytest.raises(KernelmixError, match=r"unknown preset \['tiny'\] \(choose from: tiny, mini, small"):
            ModelConfig.preset(["tiny"])
