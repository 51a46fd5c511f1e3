"""The README's examples say what really happens."""

import re
import subprocess
import sys
from pathlib import Path

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_the_python_example_gives_what_the_readme_says(tmp_path):
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code.replace("results                                  #", "print(results)  #")
                      + "\nprint(sorted({e.op for e in results.traces[0].events}))\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[32.0, 32.0, 32.0, 32.0]" in out.stdout
    assert "[rank 3] sum: [8.0, 8.0, 8.0, 8.0]" in out.stdout
    assert "['all_reduce']" in out.stdout


def test_the_run_example_shows_the_numbers_a_run_gives():
    from minitp import runs

    report = runs.run_ddp(nproc=4)
    shown = README.split("minitp run ddp: 4 ranks", 1)[1]
    for traced in report["comm_bytes_traced"]:
        assert f"{traced:,.0f}" in shown
    for loss in report["reference_loss"]:
        assert f"{loss:.4f}" in shown
    assert f"{report['memory'][0]['optimizer']:,}" in shown


def test_every_train_and_sample_flag_the_readme_shows_exists(capsys):
    from minitp import cli

    for command in ("train", "sample"):
        try:
            cli.main([command, "--help"])
        except SystemExit:
            pass
        known = set(re.findall(r"--[a-z-]+", capsys.readouterr().out))
        lines = [line for line in README.splitlines() if re.search(rf"minitp(\.cli)? {command} ", line)]
        assert lines, command
        for line in lines:
            shown = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", line.split("#")[0].split(f" {command} ", 1)[1]))
            assert shown <= known, (line, shown - known)
