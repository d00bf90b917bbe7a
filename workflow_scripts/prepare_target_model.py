"""Rule prepare_target_model: materialize the embedded SmolLM2-135M-Instruct target."""

from eagle3_pipeline.runtime import start_log
from eagle3_pipeline.target_model import materialize_builtin_target

if __name__ == "__main__":
    start_log(snakemake.log[0])  # noqa: F821 (injected by Snakemake)
    materialize_builtin_target(snakemake.output[0], dtype=snakemake.params.dtype)  # noqa: F821
