"""Sharing the port with a teammate on the LAN: the port announced and found over mDNS
(`discovery`), the ready-to-paste client configuration the Sharing tab shows (`snippets`),
`gguf-studio connect`, a teammate getting a key and a working client set-up (`connect`),
and the Codex CLI and OpenCode configuration it writes (`client_config`)."""
