"""The npuq run command line the run tests share."""


def run_argv(inputs, out, *extra):
    """``npuq run`` on the tiny inputs: cheap sizes, a fixed target and one thread."""
    folder, text = inputs
    return ["run", "--model", str(folder), "--calib-corpus", f"file:{text}", "--eval-corpus", f"file:{text}",
            "--context", "32", "--calib-tokens", "64", "--eval-tokens", "64", "--gen-tokens", "4",
            "--qnn-version", "2.51", "--htp-arch", "73", "--num-threads", "1", "--out", str(out), *extra]
