"""The command line's commands that do not run the service (`backend.app.cli` holds the
parser, `main` and the commands that do): Hugging Face (`cli_hub`: `search`, `pull`,
`hf-token`), named keys and teammates' requests for one (`cli_keys`), and a running
port's recent requests (`cli_requests`)."""
