"""The application: the service the window and the command line drive (`service`), the
command line (`cli`), the end-to-end self-test, client snippets, activity over time and
the desktop entry."""
