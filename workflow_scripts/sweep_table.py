"""Rule sweep_table: tau and training cost of the run's drafter and every sweep variant's, as JSON and Markdown."""

import logging

from eagle3_pipeline.io import read_json, write_json_atomic, write_text_atomic
from eagle3_pipeline.runtime import start_log
from eagle3_pipeline.sweep import format_table, sweep_row

if __name__ == "__main__":
    sm = snakemake  # noqa: F821 (injected by Snakemake)
    start_log(sm.log[0])
    rows = [
        sweep_row(r["name"], r["changes"], read_json(acc), read_json(train), read_json(cov), r["shared"])
        for r, acc, train, cov in zip(sm.params.rows, sm.input.acceptance, sm.input.train_summary, sm.input.coverage, strict=True)
    ]
    table = format_table(rows)
    write_json_atomic(sm.output.json, {"rows": rows})
    write_text_atomic(sm.output.table, table)
    logging.getLogger("sweep_table").info("%d drafters:\n%s", len(rows), table)
