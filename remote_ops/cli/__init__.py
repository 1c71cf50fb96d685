"""The CLI process: `launch` (the console script), `main` (the click group and the one error
boundary), `app` (per-run context), `console` (the only printer) and `commands/` (parse, call one
workflow, render).  Nothing here is imported by workflows, core or the seams."""
