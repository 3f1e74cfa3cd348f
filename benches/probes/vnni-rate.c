// How fast one core runs `vpdpbusd` on 512-bit registers: with every operand in a register, with the activation
// word broadcast from memory (as the VNNI row-group kernels take it), with one broadcast serving two weight vectors,
// and `vpmulld` for comparison. Eight independent chains each. A probe of the CPU, not of the engine.
// gcc's code for these loops carries register-to-register copies beside the `vpdpbusd` (objdump shows them), so
// the rates are lower bounds and move from run to run.
//
//   gcc -O2 -mavx512f -mavx512vnni -mavx512bw benches/probes/vnni-rate.c -o /tmp/vnni-rate && /tmp/vnni-rate
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  long n=200000000; int8_t buf[4096] __attribute__((aligned(64)));
  for(int i=0;i<4096;i++)buf[i]=i;
  __m512i w0=_mm512_set1_epi32(0x01020304), w1=_mm512_set1_epi32(0x05060708);
  __m512i a[8]; for(int i=0;i<8;i++)a[i]=_mm512_setzero_si512();
  double t=now();
  for(long i=0;i<n;i++){
    #pragma GCC unroll 8
    for(int c=0;c<8;c++) a[c]=_mm512_dpbusd_epi32(a[c],w0,w1);
    __asm__ volatile(""::"v"(w1));
  }
  t=now()-t; __m512i s=a[0]; for(int i=1;i<8;i++)s=_mm512_add_epi32(s,a[i]);
  printf("reg: %.2f G vpdpbusd/s (%d)\n",8.0*n/t/1e9,_mm512_reduce_add_epi32(s));
  for(int i=0;i<8;i++)a[i]=_mm512_setzero_si512();
  t=now();
  const int8_t* p=buf;
  for(long i=0;i<n;i++){
    #pragma GCC unroll 8
    for(int c=0;c<8;c++) a[c]=_mm512_dpbusd_epi32(a[c],(c&1)?w1:w0,_mm512_set1_epi32(*(const int*)(p+4*c)));
    p = buf + ((i&63)*32);
    __asm__ volatile("":"+r"(p));
  }
  t=now()-t; s=a[0]; for(int i=1;i<8;i++)s=_mm512_add_epi32(s,a[i]);
  printf("bcast mem: %.2f G vpdpbusd/s (%d)\n",8.0*n/t/1e9,_mm512_reduce_add_epi32(s));
  // 2 weight vectors sharing each broadcast
  for(int i=0;i<8;i++)a[i]=_mm512_setzero_si512();
  t=now();
  p=buf;
  for(long i=0;i<n;i++){
    #pragma GCC unroll 4
    for(int c=0;c<4;c++){ __m512i b=_mm512_set1_epi32(*(const int*)(p+4*c)); a[2*c]=_mm512_dpbusd_epi32(a[2*c],w0,b); a[2*c+1]=_mm512_dpbusd_epi32(a[2*c+1],w1,b);}
    p = buf + ((i&63)*32);
    __asm__ volatile("":"+r"(p));
  }
  t=now()-t; s=a[0]; for(int i=1;i<8;i++)s=_mm512_add_epi32(s,a[i]);
  printf("bcast shared by 2: %.2f G vpdpbusd/s (%d)\n",8.0*n/t/1e9,_mm512_reduce_add_epi32(s));
  // vpmulld throughput
  for(int i=0;i<8;i++)a[i]=_mm512_set1_epi32(i+1);
  t=now();
  for(long i=0;i<n;i++){
    #pragma GCC unroll 8
    for(int c=0;c<8;c++) a[c]=_mm512_mullo_epi32(a[c],w0);
  }
  t=now()-t; s=a[0]; for(int i=1;i<8;i++)s=_mm512_add_epi32(s,a[i]);
  printf("vpmulld: %.2f G/s (%d)\n",8.0*n/t/1e9,_mm512_reduce_add_epi32(s));
}
