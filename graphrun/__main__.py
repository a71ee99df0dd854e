from graphrun.cli.main import entry

entry()
