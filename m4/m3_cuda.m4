# M3_CHECK_CUDA: the --with-cuda=DIR probe.
# Finds the NVRTC, driver-API (stub library when no driver is installed), cuBLAS
# and static cudart libraries of one toolkit, and records an rpath so that a
# binary built here finds the same toolkit's libraries on the GPU machine.
AC_DEFUN([M3_CHECK_CUDA], [
  AC_ARG_WITH([cuda],
    [AS_HELP_STRING([--with-cuda=DIR], [CUDA toolkit root (default /usr/local/cuda)])],
    [CUDA_HOME=$withval], [CUDA_HOME=/usr/local/cuda])
  AS_IF([test -f "$CUDA_HOME/include/nvrtc.h"], [],
    [AC_MSG_ERROR([nvrtc.h not found under $CUDA_HOME/include; pass --with-cuda=DIR])])
  CUDA_LIBDIR=$CUDA_HOME/lib64
  AS_IF([test -d "$CUDA_LIBDIR"], [], [CUDA_LIBDIR=$CUDA_HOME/lib])
  CUDA_CPPFLAGS="-I$CUDA_HOME/include"
  save_LDFLAGS=$LDFLAGS; save_CPPFLAGS=$CPPFLAGS; save_LIBS=$LIBS
  CPPFLAGS="$CPPFLAGS $CUDA_CPPFLAGS"
  LDFLAGS="$LDFLAGS -L$CUDA_LIBDIR -L$CUDA_LIBDIR/stubs"
  AC_CHECK_LIB([nvrtc], [nvrtcCompileProgram], [],
    [AC_MSG_ERROR([libnvrtc not found in $CUDA_LIBDIR])])
  # The driver API is dlopen()ed at run time (runtime/cuda_driver.c) so one
  # binary runs with or without a driver; only its header is needed here.
  AC_CHECK_HEADER([cuda.h], [], [AC_MSG_ERROR([cuda.h not found under $CUDA_HOME/include])])
  AC_CHECK_LIB([cublas], [cublasCreate_v2], [],
    [AC_MSG_ERROR([libcublas not found in $CUDA_LIBDIR])])
  AS_IF([test -f "$CUDA_LIBDIR/libcudart_static.a"], [],
    [AC_MSG_ERROR([libcudart_static.a not found in $CUDA_LIBDIR])])
  # NCCL (tensor parallelism) is dlopen()ed like the driver (runtime/tp_comm.c):
  # only its header is needed to build, and m3kit runs where it is absent.
  AC_CHECK_HEADER([nccl.h], [AC_DEFINE([M3_HAVE_NCCL_H], [1], [nccl.h of the CUDA toolkit found])],
    [AC_MSG_WARN([nccl.h not found under $CUDA_HOME/include: tensor-parallel communication is left out])])
  LDFLAGS=$save_LDFLAGS; CPPFLAGS=$save_CPPFLAGS; LIBS=$save_LIBS
  CUDA_LIBS="-L$CUDA_LIBDIR -L$CUDA_LIBDIR/stubs -Wl,-rpath,$CUDA_LIBDIR -lnvrtc -lcublas -lcublasLt $CUDA_LIBDIR/libcudart_static.a -lpthread -ldl -lrt"
  NVRTC_LIBS="-L$CUDA_LIBDIR -Wl,-rpath,$CUDA_LIBDIR -lnvrtc -lpthread -ldl -lrt"
  AC_SUBST([CUDA_HOME]) AC_SUBST([CUDA_CPPFLAGS]) AC_SUBST([CUDA_LIBS]) AC_SUBST([NVRTC_LIBS])
  AC_DEFINE_UNQUOTED([M3_CUDA_HOME], ["$CUDA_HOME"], [CUDA toolkit root used at build time])
  AC_DEFINE_UNQUOTED([M3_CUDA_LIBDIR], ["$CUDA_LIBDIR"], [CUDA toolkit library directory used at build time])
])
