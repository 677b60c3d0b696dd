"""The `tandem` command line, above every layer: it drives `tasks/` and `flows/`, which drive the `tandem` library.

It lives outside the library so that `tandem/` never imports the pipeline (`tasks/`, `flows/`) or the
orchestration stack (prefect, dvc, great_expectations, wandb).
"""
