"""Static CSS and JavaScript that ``speceyes view`` inlines into its page."""
