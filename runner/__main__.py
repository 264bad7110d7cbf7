from runner.cli import run

if __name__ == "__main__":  # spawned ranks import this module again: they must not re-run the CLI
    run()
