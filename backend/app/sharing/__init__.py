"""Sharing the port with a teammate on the LAN: the port announced and found over mDNS
(`discovery`) and kept announced as the settings say (`announcer`), the ready-to-paste
client configuration the Sharing tab shows (`snippets`), `gguf-studio connect`, a teammate
getting a key and a working client set-up (`connect`), the Codex CLI and OpenCode
configuration it writes (`client_config`), and the named keys as people edit and see them:
the form of `keys add|edit` and the Sharing tab's dialog, the table of keys with their
usage, the chart, and the set-up a new key's holder pastes (`key_table`)."""
