"""What a person reads: terminal tables and progress, the summary, the HTML report, result
files."""
