"""One DAPO training step over an executor, prompt sampling, health alerts — orchestration-free."""
