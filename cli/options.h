// The option parser of the subcommands (cli/options.c): each command describes its options in a
// table (CliOpt: a flag, a value taken as is, or a value a check function converts) and how it
// words its errors (CliArgs), and cli_parse_args walks argv[2..] with them. The messages are
// the ones the commands have always printed (tests compare some of them):
//
//   PREFIX NEEDS_VALUE                             "moec: error: option '-o' needs a value"
//   PREFIX unknown option 'A' for FOR (see 'HELP --help')     (without FOR: "unknown option 'A'")
//   PREFIX STRAY 'A' for FOR (see 'HELP --help')   a non-option where the command takes none
//   PREFIX SECOND ('FIRST' and 'A')                a second positional argument
#ifndef CLI_OPTIONS_H
#define CLI_OPTIONS_H

#include <stdbool.h>
#include <stdio.h>

struct CliArgs;
// Converts and checks an option's value into dest; false after reporting (cli_args_error).
typedef bool (*CliOptCheck)(const struct CliArgs *args, const char *opt, const char *value, void *dest);

typedef struct CliOpt {
  const char *name;     // "-o", "--cluster"; a name ending in '=' ("--after=") takes the value attached
  const char *alias;    // another spelling ("--verbose"), or NULL
  bool flag;            // no value: *(bool *)dest = true
  void *dest;           // flag: bool *; else with check NULL const char ** (the value as is), else check's
  CliOptCheck check;
} CliOpt;

typedef struct CliArgs {
  const char *prefix;        // NULL: "moec: error: "
  bool quiet;                // report nothing (tune's ranks other than 0); else errors go to stderr
  const char *needs_value;   // format of a missing value, with the option; NULL: "option '%s' needs a value"
  const char *for_what;      // "'moec plan'", "tune"; NULL: "unknown option 'A'" alone
  const char *help;          // "moec plan": the command whose --help the message points at
  const char *stray;         // a non-option where none is taken: "unknown argument", "unexpected argument"
  const char **positional;   // the one positional argument (input file, folder), or NULL: none
  const char *second;        // a second one: "more than one input file"
  bool dash_is_positional;   // a lone "-" is a positional argument (else an unknown option)
  const CliOpt *opts;
  int nopts;
} CliArgs;

// Parses argv[2..] (argv[1] is the command) into the table's destinations; false on a usage
// error (reported).
bool cli_parse_args(const CliArgs *a, int argc, char **argv);
// PREFIX, the message, a newline, on stderr (nothing when a->quiet). Returns false.
bool cli_args_error(const CliArgs *a, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
// Checks: a positive finite number into double * ("OPT takes a positive number, not 'V'").
bool cli_opt_positive(const CliArgs *a, const char *opt, const char *value, void *dest);

#endif
