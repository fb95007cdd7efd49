"""The main job: one command from model to deployable artifact, stage by stage, resumable."""
