"""The Textual chat app (`localrun chat`): the app and its screens, the settings panel,
conversation history, and the line REPL used when input is piped; styles in *.tcss."""
