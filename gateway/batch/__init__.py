"""The batch API's work: the runner that feeds queued requests through the pipeline, progress logs."""
