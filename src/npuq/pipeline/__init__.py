"""The main job, ``npuq run``: one command from model to deployable artifact, stage by stage,
cached and resumable; and the glue that opens the runnable graphs of any folder.

    stages.py      RunDir: stage folders keyed by the hash of their inputs, written atomically
    job.py         the stages of npuq run and the order they run in
    programs.py    open_programs: an artifact's PT2E programs or an export's ONNX sessions
"""
