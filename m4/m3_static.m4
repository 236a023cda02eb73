# M3_STATIC_LIB(VAR, PKG, LIBNAME, EXTRA): set VAR_LIBS to the static archive
# lib<LIBNAME>.a found in pkg-config PKG's libdir (or the multiarch dir), plus
# EXTRA.  The GPU machine has none of these libraries, so programs built here
# must carry them.
AC_DEFUN([M3_STATIC_LIB], [
  m3_libdir=`$PKG_CONFIG --variable=libdir $2 2>/dev/null`
  m3_archive=
  for m3_d in "$m3_libdir" /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib /usr/local/lib; do
    AS_IF([test -n "$m3_d" && test -f "$m3_d/lib$3.a"], [m3_archive="$m3_d/lib$3.a"; break])
  done
  AS_IF([test -z "$m3_archive"], [AC_MSG_ERROR([static library lib$3.a not found (install the -dev package of $2)])])
  $1_LIBS="$m3_archive $4"
  AC_MSG_NOTICE([linking $3 statically: $m3_archive])
])
