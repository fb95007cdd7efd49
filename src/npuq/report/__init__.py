"""Reports people want to read: report.json and a self-contained report.html."""
