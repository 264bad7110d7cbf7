from runner.cli import run

run()
